"""The zoo's save round trip (``benchmarks/zoo.py``): after a correct tp load, ``sw.save``
must write back exactly the checkpoint the family was loaded from.

The checkpoint was written by ``save_pretrained``, so the comparison is exact: the same keys,
and every tensor with the same dtype, shape and bytes. Then the library's own
``from_pretrained`` of the saved folder, in one process, must give the reference output.
Results: pass; refused (``sw.save`` raised a ``CheckpointError`` before writing: a layout it
cannot write back, named); SILENT WRONG (saved without an error but not equal); error.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = fh.get_tensor(key)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def byte_diff(source: Path, saved: Path) -> str:
    """"" when ``saved`` holds exactly ``source``'s tensors, key by key and byte for byte;
    else what differs first."""
    a, b = _tensors(source), _tensors(saved)
    missing, extra = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if missing or extra:
        return f"keys missing {missing[:3]}, unexpected {extra[:3]}"
    for key in sorted(a):
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{key}: {y.dtype} {tuple(y.shape)} written, {x.dtype} {tuple(x.shape)} stored"
        if not torch.equal(_bytes(x), _bytes(y)):
            return f"{key}: other bytes"
    return ""


def save_round_trip(case, model, data, compare) -> dict:
    """Every rank: ``sw.save(model)``; rank 0 then compares the folder with the source and
    reloads it in one process. Never raises (the result says what happened)."""
    import torch.distributed as dist
    from _zoo_models import first_line, import_name, run_forward

    import shardwise as sw

    out = Path(case.folder + "-swsave")
    try:
        sw.save(model, out, overwrite=True)
    except sw.CheckpointError as e:
        return {"status": "refused", "detail": "save: " + first_line(e)}
    except Exception as e:  # noqa: BLE001 - every failure is a row of the report
        return {"status": "error", "detail": "save: " + first_line(e)}
    if dist.is_initialized() and dist.get_rank() != 0:
        return {"status": "pass"}
    try:
        diff = byte_diff(Path(case.folder), out)
        if diff:
            return {"status": "wrong", "detail": f"save not byte-equal to the source: {diff}"}
        cls = import_name(case.model_class)
        kwargs = {"dtype": torch.float32} if case.library == "transformers" else {}
        _, got = run_forward(cls.from_pretrained(out, **kwargs).eval(), case.library, data["inputs"])
        result = compare(got, data["reference"])
        if result["status"] != "pass":
            return {"status": "wrong", "detail": "from_pretrained of the save: " + result["detail"]}
        return {"status": "pass"}
    except Exception as e:  # noqa: BLE001
        return {"status": "error", "detail": "save check: " + first_line(e)}
    finally:
        shutil.rmtree(out, ignore_errors=True)
