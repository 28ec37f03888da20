"""A second Storage end to end: ``tests/memstore.py`` (an object store in a manager process,
shared by spawned gloo ranks; no mmap, immutable objects, a staging prefix published index
last) serves every public verb, registered here and nowhere else: the load at tp=2, the
gather save, the DCP save at tp=2 reloaded at tp=1, the optimizer state, consolidation into
a local folder, verify / diff / inspect. Each is checked against the same verb on local files."""

import pytest
import torch

import memstore
import shardwise as sw
from harness import run_ranks
from models import make_model, tiny_plan
from shardwise.core.spec import split
from shardwise.io.storage import locate, read_small
from shardwise.parallel import get_shard_state, local_of

SHARD_SIZE = 40_000  # several files: the index is published too


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _locals(model) -> dict[str, torch.Tensor]:
    return {n: local_of(t).detach() for n, t in model.state_dict(keep_vars=True).items()}


def _meta():
    with torch.device("meta"):
        return make_model()


def _ranks(root: str, options: dict):
    memstore.register()
    mem = "memstore://ckpt"
    backend = sw.init_backend("gloo")
    tp2, tp1 = backend.mesh(tp=2), backend.mesh(dp_replicate=2, tp=1)
    ref = make_model().state_dict()

    # a full load at tp=2 from the store equals the load of the same files from the disk
    ours, theirs = _meta(), _meta()
    result = sw.load(ours, f"{mem}/src", plan=tiny_plan(), mesh=tp2, holding="local", storage_options=options)
    sw.load(theirs, f"{root}/src", plan=tiny_plan(), mesh=tp2, holding="local")
    assert result.bytes_read > 0 and result.missing_keys == ()
    got, want = _locals(ours), _locals(theirs)
    assert got.keys() == want.keys() and all(_same(got[n], want[n]) for n in want)
    state = get_shard_state(ours)
    assert all(_same(got[n], split(ref[n], spec, 2, state.tp_rank)) for n, spec in state.specs.items())

    # the gather save and the DCP save of the tp=2 model, into the store and onto the disk
    sw.save(ours, f"{mem}/gather", max_shard_size=SHARD_SIZE, storage_options=options)
    sw.save(ours, f"{root}/gather", max_shard_size=SHARD_SIZE)
    sw.save(ours, f"{mem}/dcp", distributed=True, storage_options=options)
    with pytest.raises(sw.CheckpointError, match="already exists"):
        sw.save(ours, f"{mem}/dcp", distributed=True, storage_options=options)

    # the DCP checkpoint reloads at another degree (tp=1, two replicas) as the whole model
    again = _meta()
    sw.load(again, f"{mem}/dcp", plan=tiny_plan(), mesh=tp1, storage_options=options)
    assert all(_same(t, ref[n]) for n, t in _locals(again).items())

    # optimizer state: saved at tp=2 into the store, loaded at tp=1, as from the disk
    grads = make_model(seed=5).state_dict()
    for p_name, p in ours.named_parameters():
        p.grad = split(grads[p_name], state.specs[p_name], 2, state.tp_rank)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=0.01, betas=(0.8, 0.9))
    optimizer.step()
    sw.save_optimizer(ours, optimizer, f"{mem}/optim", storage_options=options)
    sw.save_optimizer(ours, optimizer, f"{root}/optim")
    states = []
    for where, opts in ((f"{mem}/optim", options), (f"{root}/optim", None)):
        model = _meta()
        sw.load(model, f"{root}/src", plan=tiny_plan(), mesh=tp1)
        resumed = torch.optim.AdamW(model.parameters(), lr=0.5)
        sw.load_optimizer(model, resumed, where, storage_options=opts)
        assert resumed.param_groups[0]["lr"] == 0.01
        states.append({(i, k): local_of(v).clone() for i, s in enumerate(resumed.state.values())
                       for k, v in s.items()})
    assert states[0].keys() == states[1].keys() and all(_same(states[0][k], states[1][k]) for k in states[1])
    memstore.unregister()
    return True


def _objects(location) -> dict[str, bytes]:
    return {n: read_small(location / n, what="an object", cap=1 << 30) for n in location.list()}


def test_every_verb_over_a_second_storage(tmp_path):
    manager, options = memstore.serve()
    memstore.register()
    try:
        sw.save(make_model(), tmp_path / "src")  # one process: the source checkpoint, on disk
        sw.save(make_model(), "memstore://ckpt/src", storage_options=options)  # and in the store
        mem = locate("memstore://ckpt", options)
        local = {p.name: p.read_bytes() for p in sorted((tmp_path / "src").iterdir())}
        assert _objects(mem / "src") == local  # the gather save: byte for byte the local one

        assert run_ranks(_ranks, 2, str(tmp_path), options, timeout=240) == [True, True]
        gathered = {p.name: p.read_bytes() for p in sorted((tmp_path / "gather").iterdir())}
        assert len(gathered) > 2 and _objects(mem / "gather") == gathered
        assert not any(n.startswith(".") for n in mem.list())  # no staging prefix left

        # consolidated out of the store into a local folder: byte for byte the gather save
        merged = sw.consolidate("memstore://ckpt/dcp", tmp_path / "merged", max_shard_size=SHARD_SIZE,
                                storage_options=options)
        assert {p.name: p.read_bytes() for p in sorted(merged.iterdir())} == gathered

        for name in ("src", "gather", "dcp"):
            report = sw.verify(f"memstore://ckpt/{name}", storage_options=options)
            assert report.ok and report.verified, (name, report.summary())
        assert sw.diff("memstore://ckpt/dcp", tmp_path / "gather", storage_options=options).identical
        report = sw.inspect("memstore://ckpt/dcp", storage_options=options)
        assert report.kind == "torch distributed checkpoint (DCP)" and str(report.path) == "memstore://ckpt/dcp"
        assert len(report.tensors) == len(make_model().state_dict())
    finally:
        memstore.unregister()
        manager.shutdown()
