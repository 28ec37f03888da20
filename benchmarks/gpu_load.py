"""One-GPU load benchmark: a transformers Llama checkpoint onto the GPU, shardwise against the
loaders users pick instead, each load in a fresh process, interleaved round by round.

    python3 benchmarks/gpu_load.py --size 8GB --repeat 3          # on a machine with a CUDA GPU
    python3 benchmarks/gpu_load.py --device cpu --size 64MB        # the same on the CPU (gloo)

The checkpoint: a LlamaForCausalLM in bfloat16 written by ``save_pretrained`` (several files),
page cache warm before every load. Methods, each timed from the start of the load to a model
whose every weight is on the device (``torch.cuda.synchronize``):

- shardwise: ``sw.from_pretrained(LlamaForCausalLM, folder, mesh=sw.init_backend("nccl").mesh(tp=1))``
  (a world of one; the process group exists before the clock starts);
- transformers: ``LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device)``;
- safetensors: the model built on meta, ``safetensors.torch.load_file(file, device=device)`` for
  every file, ``load_state_dict(..., assign=True)``;
- runai-model-streamer (where installed): ``SafetensorsStreamer.stream_files(files, device=device)``,
  every tensor into a meta-built model;
- fastsafetensors (where installed): ``SafeTensorsFileLoader`` (``nogds=True``) over the files,
  ``copy_files_to_device``, every tensor into a meta-built model.

Per load: seconds, GB/s of checkpoint bytes, peak host RSS above the level before the load (VmHWM
reset), and peak device memory. Every method's weights (an exact integer checksum of each tensor's
bits) and first-forward logits must equal shardwise's, or the run raises. The median of
``--repeat`` rounds is reported with its ratio to shardwise measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import GB, OUT_DIR, PeakRSS, warm_file_cache, write_doc_section, write_results
from _peers_models import llama_config

from shardwise.testing import parse_size

METHODS = ("shardwise", "transformers", "safetensors", "runai-model-streamer", "fastsafetensors")
_OPTIONAL = {"runai-model-streamer": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}


def make_checkpoint(folder: Path, total_bytes: int, device: str) -> dict:
    """Write the checkpoint once (a stamp file holds its config); weights drawn on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = llama_config(total_bytes, kv_heads=8, ffn=3.5, step=1024)
    stamp = folder / "gpu_load_stamp.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == cfg:
        return cfg
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg, dtype=torch.bfloat16))
    model = model.to_empty(device=device).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(folder, max_shard_size="2GB")
    stamp.write_text(json.dumps(cfg))
    return cfg


def _meta_model(folder: Path):
    """Parameters on meta, buffers real (accelerate's ``init_empty_weights``, as users build one)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        return LlamaForCausalLM(config)  # dtypes come with the assigned tensors


def _assign(model, tensors: dict) -> None:
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _load(method: str, folder: Path, device: torch.device, backend):
    files = sorted(str(f) for f in folder.glob("*.safetensors"))
    if method == "shardwise":
        from transformers import LlamaForCausalLM

        import shardwise as sw

        return sw.from_pretrained(LlamaForCausalLM, folder, mesh=backend.mesh(tp=1))
    if method == "transformers":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=str(device))
    model = _meta_model(folder)
    tensors: dict[str, torch.Tensor] = {}
    if method == "safetensors":
        from safetensors.torch import load_file

        for f in files:
            tensors.update(load_file(f, device=str(device)))
    elif method == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files, device=str(device))
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor.to(device, non_blocking=True).clone()
    elif method == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        opened = fastsafe_open(files, device=str(device), nogds=True)  # no GPUDirect Storage here
        for name in opened.keys():
            tensors[name] = opened.get_tensor(name)  # keeps its file buffer alive
    else:
        raise ValueError(f"unknown method {method!r}; one of {METHODS}")
    _assign(model, tensors)
    return model.to(device)  # the buffers; the weights are there already


def _checksum(model) -> dict[str, int]:
    """An exact integer per tensor: the sum of its bytes weighted by position mod 251."""
    out = {}
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):  # a DTensor (shardwise's holding on a mesh)
            t = t.full_tensor()
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
        weights = torch.arange(data.numel(), device=data.device) % 251 + 1
        out[name] = int((data * weights).sum().item())
    if not out:
        raise RuntimeError("no tensors in the model's state dict")
    return out


def _preimport(method: str) -> None:
    import accelerate  # noqa: F401
    import safetensors.torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    if method in _OPTIONAL:
        __import__(_OPTIONAL[method])


def one(method: str, folder: Path, device_name: str, out: Path) -> None:
    """Run in a fresh process: one load, its figures and checks written to ``out`` as JSON."""
    backend = None
    if device_name == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context exists before the clock starts
    else:
        device = torch.device("cpu")
    if method == "shardwise":
        import shardwise as sw

        for k, v in {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(29500 + os.getpid() % 1000),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }.items():
            os.environ.setdefault(k, v)
        backend = sw.init_backend("nccl" if device_name == "cuda" else "gloo")
    _preimport(method)  # imports are not load time: the first H200 run counted them, for every method
    if device_name == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        model = _load(method, folder, device, backend)
        if device_name == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    model.eval()
    placed = {p.device.type for p in model.parameters()}
    if placed != {device.type}:
        raise RuntimeError(f"{method}: parameters on {placed}, expected all on {device.type}")
    ids = torch.arange(1, 17, device=device).reshape(1, 16) * 97 % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    local = model.state_dict()
    result = {
        "method": method,
        "seconds": seconds,
        "peak_rss": peak.bytes,
        "peak_device": torch.cuda.max_memory_allocated(device) if device_name == "cuda" else 0,
        "checksum": _checksum(model),
        "logits": logits.cpu().reshape(-1)[:4096].tolist(),
        "bytes": sum(t.numel() * t.element_size() for t in local.values()),
    }
    out.write_text(json.dumps(result))
    if backend is not None:
        backend.shutdown()


def _available(method: str) -> str | None:
    module = _OPTIONAL.get(method)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means the peer cannot run here
        return f"{module} not importable: {type(e).__name__}: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="8GB", help="checkpoint size (default 8GB)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the median is reported")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "shardwise-bench-gpu-load")
    p.add_argument(
        "--out",
        type=Path,
        help="folder for the JSON (default: benchmarks/results/ from a clean tree, else benchmarks/out/)",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds per load process")
    p.add_argument(
        "--from-json",
        type=Path,
        help="only publish a run saved elsewhere (the device machine's "
        "JSON): into benchmarks/results/ and docs/benchmarks.md",
    )
    p.add_argument("--one", nargs=2, metavar=("METHOD", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        one(args.one[0], args.dir, args.device, Path(args.one[1]))
        return 0
    if args.from_json:
        payload = json.loads(args.from_json.read_text())
        # measured on a copy of the tree without git: the commit comes from SHARDWISE_COMMIT there
        payload["machine"]["commit"] = payload["machine"]["commit"] or payload.get("commit_measured") or ""
        (OUT_DIR / f"{payload['name']}.json").write_text(json.dumps(payload, indent=1) + "\n")
        print(write_doc_section(payload))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_load: no CUDA device here (torch.cuda.is_available() is False); use --device cpu",
            file=sys.stderr,
        )
        return 2

    t = time.perf_counter()
    cfg = make_checkpoint(args.dir, parse_size(args.size), args.device)
    files = sorted(args.dir.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    print(
        f"checkpoint: {len(files)} files, {total / GB:.2f} GB, {cfg} ({time.perf_counter() - t:.0f}s)",
        flush=True,
    )
    skipped = {m: why for m in args.methods if (why := _available(m))}
    methods = [m for m in args.methods if m not in skipped]
    for m, why in skipped.items():
        print(f"skip {m}: {why}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    failed: dict[
        str, str
    ] = {}  # a peer that fails is reported, not timed again; shardwise failing ends the run
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for m in [m for m in methods if m not in failed]:
                warm_file_cache(files)
                out = Path(tmp) / f"{m}-{r}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    "--one",
                    m,
                    str(out),
                    "--dir",
                    str(args.dir),
                    "--device",
                    args.device,
                ]
                try:
                    proc = subprocess.run(
                        cmd, timeout=args.timeout, capture_output=True, text=True, check=False
                    )
                    why = f"exit {proc.returncode}" if proc.returncode else ""
                    tail = proc.stderr[-4000:]
                except subprocess.TimeoutExpired as e:
                    why, tail = f"no result within {args.timeout:.0f}s", str(e.stderr or "")[-4000:]
                if why:
                    print(f"round {r} {m} FAILED ({why}):\n{tail}", file=sys.stderr, flush=True)
                    if m == methods[0]:
                        raise RuntimeError(f"{m} failed in round {r} ({why}); its output is above")
                    failed[m] = f"{why}: {tail.strip().splitlines()[-1] if tail.strip() else 'no output'}"
                    continue
                res = json.loads(out.read_text())
                runs[m].append(res)
                print(
                    f"round {r} {m}: {res['seconds']:.2f}s, {res['bytes'] / res['seconds'] / GB:.2f} GB/s, "
                    f"peak RSS {res['peak_rss'] / GB:.2f} GB, device {res['peak_device'] / GB:.2f} GB",
                    flush=True,
                )
    methods = [m for m in methods if m not in failed]
    ref = runs[methods[0]][0]
    same_weights = {m: all(r["checksum"] == ref["checksum"] for r in runs[m]) for m in methods}
    same_logits = {m: all(r["logits"] == ref["logits"] for r in runs[m]) for m in methods}
    base = statistics.median(r["seconds"] for r in runs[methods[0]])
    rows = []
    for m in methods:
        secs = statistics.median(r["seconds"] for r in runs[m])
        rows.append(
            {
                "method": m,
                "seconds": secs,
                "gb_per_s": total / secs / GB,
                "x_shardwise": secs / base,
                "peak_rss_gb": statistics.median(r["peak_rss"] for r in runs[m]) / GB,
                "peak_device_gb": statistics.median(r["peak_device"] for r in runs[m]) / GB,
                "same_weights": "yes" if same_weights[m] else "NO",
                "same_logits": "yes" if same_logits[m] else "no",
            }
        )
    columns = [
        ("method", "method", None),
        ("seconds", "load s (median)", ".2f"),
        ("gb_per_s", "GB/s", ".2f"),
        ("x_shardwise", "time ÷ shardwise", ".2f"),
        ("peak_rss_gb", "peak host RSS GB", ".2f"),
        ("peak_device_gb", "peak device GB", ".2f"),
        ("same_weights", "weights = shardwise's"),
        ("same_logits", "logits = shardwise's"),
    ]
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    notes = (
        f"{device_name}, torch {torch.__version__}; a Llama of {total / GB:.2f} GB bf16 in {len(files)} "
        f"files, page cache warm, each load in a fresh process, {args.repeat} rounds interleaved, "
        f"median. Weights compared by an exact checksum of every tensor's bits, first-forward logits "
        f"(16 tokens) exactly. " + "".join(f"Not run: {m} ({why}). " for m, why in skipped.items())
    )
    name = "gpu-load" if args.device == "cuda" else "gpu-load-cpu"
    extra = {"runs": runs, "config": cfg, "commit_measured": os.environ.get("SHARDWISE_COMMIT", "")}
    table = write_results(name, rows, columns, notes=notes, extra=extra, out_dir=args.out)
    print(table)
    wrong = [m for m in methods if not same_weights[m]]
    if wrong:  # the figures are saved for the record, but a load that differs is a failure
        print(f"gpu_load: the weights of {wrong} differ from {methods[0]}'s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
