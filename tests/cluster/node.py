"""What a rank of the simulated-cluster tests runs (under torchrun on every node; see
test_cluster.py), or one process on one node (``upload``, ``absent``).

    python node.py MODE OUT [ARGS...]

Each rank writes ``OUT/rank<R>.json``: its node's host name, what it checked, and for a fault
mode when it raised (``time.time()``: one clock for every node of this machine) and what.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

import shardwise as sw
from shardwise.testing import model as toy
from shardwise.validate.checks import expected_local, same_bytes

# a dense toy of about 13 MB (fp32): big enough that HTTP requests are a small part of the bytes
CONFIG = toy.ModelConfig(vocab=4096, hidden=256, heads=16, kv_heads=8, head_dim=16, inter=512,
                         moe_layers=(False, False))
PLAN = toy.tp_plan(CONFIG)


def _model(seed: int | None = None):
    if seed is None:
        return toy.build(device="meta", config=CONFIG)
    return toy.build(seed, config=CONFIG)


def _mismatches(model, seed: int = 0) -> list[str]:
    """The parameters whose local shard is not, byte for byte, its part of the seed's model."""
    truth = dict(_model(seed).named_parameters())
    state = sw.parallel.get_shard_state(model)
    bad = []
    for name, p in model.named_parameters():
        local = sw.parallel.local_of(p).detach()
        if not same_bytes(local, expected_local(truth[name].detach(), name, state, p)):
            bad.append(name)
    return bad


def _record(out: str, rank: int, **fields) -> None:
    fields.update(rank=rank, host=socket.gethostname(), tmp=sorted(os.listdir("/tmp")))
    Path(out, f"rank{rank}.json").write_text(json.dumps(fields))


def upload(out: str, url: str) -> None:
    """One process: the toy's checkpoint to ``url`` (a gathered save, world of one)."""
    sw.save(_model(0), url, overwrite=True, progress=False)
    Path(out, "upload.json").write_text(json.dumps({"bytes": sum(
        p.numel() * p.element_size() for p in _model(0).parameters())}))


def absent(out: str, url: str) -> None:
    """One process: whether ``url`` loads as a checkpoint (it must not, after a failed save);
    the prefix's objects are listed too."""
    backend = sw.init_backend("gloo")  # a world of one
    try:
        sw.load(_model(), url, plan=PLAN, mesh=backend.mesh(tp=1), progress=False)
        outcome = "loaded"
    except Exception as e:  # the error is the expected outcome
        outcome = f"{type(e).__name__}: {e}"
    import obstore
    from obstore.store import S3Store

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    store = S3Store(bucket, client_options={"allow_http": True})
    left = [o["path"] for batch in obstore.list(store, prefix=prefix.rsplit("/", 1)[0]) for o in batch]
    Path(out, "absent.json").write_text(json.dumps({"outcome": outcome, "objects": left}))


def replicas(out: str, url: str) -> None:
    """dp=2 over the nodes, tp=2 inside each: every region read from the store by one replica."""
    backend = sw.init_backend("gloo")
    model = _model()
    result = sw.load(model, url, plan=PLAN, mesh=backend.mesh(dp_replicate=2, tp=2), progress=False)
    _record(out, backend.rank, bytes_read=result.bytes_read, bad=_mismatches(model))


def tp_load(out: str, url: str) -> None:
    """tp over every rank (one per node): each node needs its share of the checkpoint from the
    store; the rowwise pieces its peers fetched come over the collectives."""
    backend = sw.init_backend("gloo")
    model = _model()
    result = sw.load(model, url, plan=PLAN, mesh=backend.mesh(tp=backend.world_size), progress=False)
    share = sum(sw.parallel.local_of(p).numel() * p.element_size() for p in model.parameters())
    _record(out, backend.rank, bytes_read=result.bytes_read, share=share, bad=_mismatches(model))


def saves(out: str, url: str, local: str) -> None:
    """A distributed save to ``local`` (each node's private /tmp), then the same save to
    ``url`` (s3://) reloaded at tp=4 over both nodes, byte for byte."""
    backend = sw.init_backend("gloo")
    model = _model(0)
    model = sw.parallelize(model, PLAN, backend.mesh(dp_replicate=2, tp=2))
    try:
        sw.save(model, local, distributed=True, progress=False)
        local_outcome = "saved"
    except Exception as e:  # the expected outcome: recorded, the test judges it
        local_outcome = f"{type(e).__name__}: {e}"
    sw.save(model, url, distributed=True, overwrite=True, progress=False)
    again = _model()
    sw.load(again, url, plan=PLAN, mesh=backend.mesh(tp=4), progress=False)
    _record(out, backend.rank, local=local_outcome, local_exists=Path(local).exists(), bad=_mismatches(again))


def transfer(out: str) -> None:
    """A trainer on one node (tp=2, ranks 0-1) hands its weights to an engine on the other
    (tp=2, ranks 2-3): every byte crosses the nodes."""
    from torch.distributed.device_mesh import DeviceMesh

    backend = sw.init_backend("gloo")
    rank = backend.rank
    src_mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("tp",))
    dst_mesh = DeviceMesh("cpu", torch.tensor([2, 3]), mesh_dim_names=("tp",))
    src = sw.parallelize(_model(0), PLAN, src_mesh) if rank in (0, 1) else None
    dst = sw.parallelize(_model(7), PLAN, dst_mesh) if rank in (2, 3) else None
    plan = sw.transfer_plan(src, dst)
    plan.run()
    _record(out, rank, bad=_mismatches(dst) if dst is not None else [], plan=str(plan))


def _bump(model) -> None:
    """Add 1 to every local shard: the k-th save of a fault run holds seed 0 + k (``verify``)."""
    with torch.no_grad():
        for p in model.parameters():
            sw.parallel.local_of(p).add_(1)


def fault(out: str, what: str, url: str, target: str, timeout: str, rounds: str = "30") -> None:
    """``what`` (``load`` from ``url``; ``gather`` or ``save``: a gather or distributed save to
    ``target``; ``transfer``: node 0's tp=2 to node 1's) ``rounds`` times, every timeout at
    ``timeout`` seconds, while the test takes a node's link down, kills it or slows it; record
    when and how this rank raised (or that it did not). A save whose ``target`` ends in ``/``
    goes to a new prefix each round (the failed one must be absent); otherwise each round
    overwrites ``target`` with seed 0 + round (``verify`` finds which one it holds)."""
    seconds, rounds_n = float(timeout), int(rounds)
    backend = sw.init_backend("gloo", timeout=seconds)
    options = {"timeout": seconds, "retries": 1}
    rank = backend.rank
    if what == "transfer":
        from torch.distributed.device_mesh import DeviceMesh

        src_mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("tp",))
        dst_mesh = DeviceMesh("cpu", torch.tensor([2, 3]), mesh_dim_names=("tp",))
        src = sw.parallelize(_model(0), PLAN, src_mesh) if rank in (0, 1) else None
        dst = sw.parallelize(_model(7), PLAN, dst_mesh) if rank in (2, 3) else None
        plan = sw.transfer_plan(src, dst)
    else:
        model = _model()
        mesh = backend.mesh(dp_replicate=2, tp=2)
        if what != "load":
            sw.load(model, url, plan=PLAN, mesh=mesh, progress=False, storage_options=options)
    backend.barrier()
    Path(out, f"started{rank}").write_text(json.dumps({"time": time.time(), "pid": os.getpid()}))
    failed, done = None, 0
    try:
        for i in range(rounds_n):  # bounded: the test takes the link down within the first few
            if what == "load":
                model = _model()
                sw.load(model, url, plan=PLAN, mesh=mesh, progress=False, storage_options=options)
            elif what == "transfer":
                plan.run()
            else:
                failed = f"{target}{i}" if target.endswith("/") else target
                _bump(model)
                sw.save(model, failed, distributed=what == "save", overwrite=True, progress=False,
                        storage_options=options)
            done = i + 1
        outcome, raised, failed = "no error", None, None
    except Exception as e:  # the expected outcome: recorded, the test judges it
        outcome, raised = f"{type(e).__name__}: {e}", time.time()
        traceback.print_exc()
    bad = []  # a finished run: what this rank holds is exact
    if raised is None and what == "transfer":
        bad = _mismatches(dst) if dst is not None else []
    elif raised is None and what == "load":
        bad = _mismatches(model)
    _record(out, rank, outcome=outcome, raised=raised, failed=failed, done=done, bad=bad)
    os._exit(0)  # the process group cannot be shut down cleanly across a partition


def verify(out: str, url: str, done: str) -> None:
    """One process: which of seed 0 + k, k in ``done`` and ``done + 1``, ``url`` holds, byte for
    byte (a save killed after its commit but before every rank heard of it is the second);
    None: neither (a mix, or no checkpoint). The prefix's objects are listed too."""
    backend = sw.init_backend("gloo")
    model = _model()
    sw.load(model, url, plan=PLAN, mesh=backend.mesh(tp=1), progress=False)
    loaded = dict(model.named_parameters())
    truth, held = _model(0), None
    for k in range(int(done) + 2):
        if all(torch.equal(sw.parallel.local_of(loaded[n]).detach(), p.detach())
               for n, p in truth.named_parameters()):
            held = k
            break
        _bump(truth)
    import obstore
    from obstore.store import S3Store

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    store = S3Store(bucket, client_options={"allow_http": True})
    left = [o["path"] for batch in obstore.list(store, prefix=prefix.rsplit("/", 1)[0]) for o in batch]
    Path(out, "verify.json").write_text(json.dumps({"held": held, "objects": left}))


MODES = {"upload": upload, "absent": absent, "replicas": replicas, "tp_load": tp_load, "saves": saves,
         "transfer": transfer, "fault": fault, "verify": verify}

if __name__ == "__main__":
    torch.set_num_threads(1)
    MODES[sys.argv[1]](*sys.argv[2:])
    if sys.argv[1] not in ("upload", "absent", "verify"):
        sw.shutdown_backend()
