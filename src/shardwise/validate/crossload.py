"""The CPU side of the cross-load scenario, run as its own process with no launcher
environment: a world of one on gloo, whatever backend the job runs.

``python -m shardwise.validate.crossload --read DCP --write OUT`` loads the distributed
checkpoint the job wrote on its devices (it must equal the source model, byte for byte), then
writes a distributed checkpoint of another model (seed 1) for the job to load on its devices.
It prints one JSON line: ``{"read": "ok" | error, "written": path | null}``.
"""

from __future__ import annotations

import argparse
import json
import sys

import shardwise as sw
from shardwise.parallel import get_shard_state
from shardwise.testing.model import TP_PLAN, build, canonical
from shardwise.validate.checks import compare_tensors

WRITE_SEED = 1


def _read(path: str) -> str:
    backend = sw.init_backend("gloo")
    model = build(device="meta")
    sw.load(model, path, plan=TP_PLAN, mesh=backend.mesh(tp=1), progress=False)
    compare_tensors(model.state_dict().items(), canonical(), get_shard_state(model),
                    "read on CPU/gloo:", exact=True)
    return "ok"


def _write(path: str) -> str:
    sw.init_backend("gloo")
    sw.save(build(WRITE_SEED), path, distributed=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.validate.crossload")
    parser.add_argument("--read", required=True)
    parser.add_argument("--write", required=True)
    args = parser.parse_args(argv)
    out: dict = {"read": None, "written": None}
    for key, step, path in (("read", _read, args.read), ("written", _write, args.write)):
        try:
            out[key] = step(path)
        except Exception as e:  # reported to the job, which fails the scenario with it
            out[f"{key}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
