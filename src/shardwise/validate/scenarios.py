"""The layouts a world allows and the scenarios run at each, in order, on one model per layout.
A scenario is ``fn(job, run) -> details`` on every rank: ``Unsupported`` where the backend cannot
run it, any other exception fails it. ``judge`` decides on every rank's ``details``; ``needs``
names the scenarios of the same layout it builds on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor.experimental import implicit_replication

import shardwise as sw
from shardwise.backends.base import MESH_AXES
from shardwise.holding import Holding
from shardwise.parallel import get_shard_state
from shardwise.testing import read_all
from shardwise.testing.model import (
    CONFIG,
    EP_PLAN,
    MAX_NORM,
    MAX_TP,
    TP_PLAN,
    Golden,
    batch,
    build,
    loss_of,
    optimizer_for,
)
from shardwise.validate import checks
from shardwise.validate.checks import Deferred, Mismatch, compare, compare_tensors, same_bytes

if TYPE_CHECKING:
    from shardwise.backends.base import Backend
    from shardwise.io.load import LoadResult


# -- layouts: four kinds, each at most once per world: tp, dp_shard x tp (FSDP2 over the TP
# shards), dp_replicate x tp, ep x tp; a tp degree divides the KV heads, an ep degree the experts.
@dataclass(frozen=True)
class Layout:
    """One mesh request: ``axes`` as ``backend.mesh(**axes)`` takes them, outer to inner."""

    axes: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        return "_".join(f"{a}{n}" for a, n in self.axes)

    @property
    def mesh_axes(self) -> dict[str, int]:
        return dict(self.axes)

    def has(self, axis: str) -> bool:
        return self.mesh_axes.get(axis, 1) > 1

    def __repr__(self) -> str:
        return f"Layout({self.name})"


def _layout(**axes: int) -> Layout:
    return Layout(tuple((a, axes[a]) for a in MESH_AXES if a in axes))


def layouts_for(world: int, *, max_tp: int = MAX_TP, num_experts: int = CONFIG.num_experts) -> list[Layout]:
    """Every layout kind ``world`` devices allow, in run order: the two-axis ones take the
    largest tp below ``world`` dividing it and ``max_tp``, the rest for the outer axis.

    >>> [l.name for l in layouts_for(4)]
    ['tp4', 'dp_shard2_tp2', 'dp_replicate2_tp2', 'ep2_tp2', 'ep4_tp1']
    """
    out = []
    if max_tp % world == 0:
        out.append(_layout(tp=world))
    if world == 1:
        return out
    tp = max(t for t in range(1, world) if world % t == 0 and max_tp % t == 0)
    outer = world // tp
    out.append(_layout(dp_shard=outer, tp=tp))
    out.append(_layout(dp_replicate=outer, tp=tp))
    if num_experts % outer == 0:
        out.append(_layout(ep=outer, tp=tp))
    if tp > 1 and num_experts % world == 0:  # pure expert parallel
        out.append(_layout(ep=world, tp=1))
    return out


class Unsupported(Exception):
    """This backend cannot run the scenario; the message says why."""


@dataclass
class Job:
    """What every scenario of the run shares (the same on every rank)."""

    backend: Backend
    golden: Golden
    truth: dict[str, torch.Tensor]        # the canonical tensors of the source checkpoint
    root: Path                            # a folder every rank sees
    source: Path                          # the source checkpoint (one safetensors file)
    total_bytes: int                      # tensor bytes in the source
    layouts: list[Layout]


@dataclass
class Run:
    """One layout's state, built up by its scenarios in order."""

    index: int
    layout: Layout
    model: torch.nn.Module | None = None
    bytes_read: int = 0
    folder: Path = field(default=Path("."))


def layout_limit(backend: Backend, layout: Layout) -> str | None:
    """Why ``backend`` cannot run ``layout`` at all, or None."""
    if layout.has("dp_shard") and backend.holding is Holding.LOCAL:
        return (f"dp_shard needs FSDP2 (fully_shard), which needs DTensor parameters; backend "
                f"{backend.name!r} holds plain local shards")
    return None


def place(job: Job, layout: Layout, path) -> tuple[torch.nn.Module, LoadResult]:
    """``sw.load`` the checkpoint at ``path`` onto a new mesh of ``layout``, then FSDP2 over
    ``dp_shard``. Collective: every rank calls it."""
    model, mesh = build(device="meta"), job.backend.mesh(**layout.mesh_axes)
    result = sw.load(model, path, plan=TP_PLAN, mesh=mesh, progress=False,
                     ep_plan=EP_PLAN if layout.has("ep") else None)  # None: load's default
    if layout.has("dp_shard") and job.backend.holding is Holding.DTENSOR:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    return model, result


def _next_layout(job: Job, run: Run) -> Layout:
    """The first layout after ``run``'s this backend runs (``run``'s own when it is the only one)."""
    n = len(job.layouts)
    after = (job.layouts[(run.index + step) % n] for step in range(1, n + 1))
    return next((lay for lay in after if layout_limit(job.backend, lay) is None), run.layout)


def _loaded(run: Run) -> torch.nn.Module:
    assert run.model is not None  # the runner skips a scenario whose needs did not pass
    return run.model


def _to_device(job: Job, *tensors):
    return tuple(t.to(job.backend.device) for t in tensors)


# -- the scenarios ------------------------------------------------------------------------
def load(job: Job, run: Run) -> dict:
    """Each rank streams its slice of the source; every local tensor is byte-exact."""
    run.model, result = place(job, run.layout, job.source)
    run.bytes_read = result.bytes_read
    compare_tensors(run.model.state_dict().items(), job.truth, get_shard_state(run.model), "loaded",
                    exact=True)
    return {"bytes_read": result.bytes_read, "seconds": round(result.seconds, 3)}


def judge_load(job: Job, layout: Layout, ranks: list[dict]) -> str | None:
    """Every byte read by some rank; a rank of a split layout reads less than the whole."""
    got = [r["bytes_read"] for r in ranks]
    if sum(got) < job.total_bytes:
        return f"the job read {sum(got)} bytes of a {job.total_bytes}-byte checkpoint"
    split = layout.has("tp") or layout.has("ep") or layout.has("dp_replicate")
    if split and job.backend.holding is not Holding.SPMD and max(got) >= job.total_bytes:  # spmd: one process
        return f"a rank read the whole checkpoint ({max(got)} bytes) at {layout.name}"
    return None


def forward_backward(job: Job, run: Run) -> dict:
    """Logits, loss and every gradient equal the one-process run's."""
    model = _loaded(run)
    ids, targets = _to_device(job, *batch(0))
    logits = model(ids)
    loss = loss_of(logits, targets)
    checks.settle([logits, loss])  # torch_xla: one program for both
    later, out = Deferred(), {}
    with later:
        out["logits_max_diff"] = compare(logits.float(), job.golden.logits, "logits")
    with later:
        compare(loss.detach().reshape(1), torch.tensor([job.golden.loss]), "loss")
    loss.backward()
    with later:
        out["grad_max_diff"] = compare_tensors(model.named_parameters(), job.golden.grads,
                                               get_shard_state(model), "gradient of", grads=True)
    later.raise_first()
    return out


def clip_grad_norm(job: Job, run: Run) -> dict:
    """``sw.clip_grad_norm_`` gives the one-process norm and clips like it."""
    model = _loaded(run)
    norm = sw.clip_grad_norm_(model, MAX_NORM).item()
    if abs(norm - job.golden.norm) > 1e-5 * job.golden.norm:
        raise Mismatch(f"total norm {norm!r}, one process {job.golden.norm!r}")
    grad = compare_tensors(model.named_parameters(), job.golden.clipped, get_shard_state(model),
                           "clipped gradient of", grads=True)
    return {"norm": norm, "grad_max_diff": grad}


def gather_save(job: Job, run: Run) -> dict:
    """``sw.save`` of the loaded model writes the source file back, byte for byte."""
    out = run.folder / "gather"
    try:
        sw.save(_loaded(run), out, progress=False)
    except sw.errors.UnsupportedModelError as e:
        if not run.layout.has("dp_shard"):
            raise
        # shardwise refuses on purpose (on every backend) and names the way that works,
        # which dcp_reshard runs: a distributed save, then sw.consolidate.
        raise Unsupported(f"shardwise: {str(e).splitlines()[0]}") from e
    if job.backend.rank != 0:  # rank 0 wrote it
        return {}
    files = sorted(out.glob("*.safetensors"))
    if [f.name for f in files] != [job.source.name] or files[0].read_bytes() != job.source.read_bytes():
        _first_difference(out, job)
        raise Mismatch(f"the gather save ({', '.join(f.name for f in files)}) holds the same tensors as "
                       f"the source but its file is not byte-equal to {job.source.name}")
    return {"bytes": files[0].stat().st_size}


def _first_difference(folder: Path, job: Job) -> None:
    got = read_all(folder)
    for name, want in job.truth.items():
        if name not in got:
            raise Mismatch(f"the gather save lacks {name!r}")
        if not same_bytes(got[name], want):
            raise Mismatch(f"the gather save's {name!r} differs from the source")
    extra = sorted(set(got) - set(job.truth))
    if extra:
        raise Mismatch(f"the gather save has {len(extra)} unexpected tensor(s), first {extra[0]!r}")


def dcp_reshard(job: Job, run: Run) -> dict:
    """A distributed save reloads byte-exact at another layout, consolidates (rank 0, one
    process) to the source's tensors, and both checkpoints verify."""
    dcp, merged = run.folder / "dcp", run.folder / "dcp-merged"
    sw.save(_loaded(run), dcp, distributed=True)
    target = _next_layout(job, run)
    model, _ = place(job, target, dcp)
    compare_tensors(model.state_dict().items(), job.truth, get_shard_state(model),
                    f"resharded to {target.name}", exact=True)
    details: dict[str, object] = {"reshard_to": target.name}
    if job.backend.rank == 0:  # no collective follows: the other ranks go on to the verdict
        sw.consolidate(dcp, merged)
        _first_difference(merged, job)
        for path in (dcp, merged):
            report = sw.verify(path)
            if not report.ok:
                raise Mismatch(f"sw.verify: {report.summary()}")
        details["verified"] = [str(dcp.name), str(merged.name)]
    return details


def replicas_read_once(job: Job, run: Run) -> dict:
    """On a dp_replicate layout the job reads the checkpoint once (judged over the job)."""
    return {"bytes_read": run.bytes_read}


def judge_replicas(job: Job, layout: Layout, ranks: list[dict]) -> str | None:
    total = sum(r["bytes_read"] for r in ranks)
    if total != job.total_bytes:
        return (f"the job read {total} bytes ({total / job.total_bytes:.2f} checkpoints) of a "
                f"{job.total_bytes}-byte checkpoint; the replicas should read it once")
    return None


def optimizer_reshard(job: Job, run: Run) -> dict:
    """AdamW steps on the clipped gradients; model and optimizer are saved, reloaded at another
    layout, and a second step there equals the one-process run's."""
    model, later = _loaded(run), Deferred()
    out: dict[str, object] = {}
    optimizer = optimizer_for(model.parameters())
    with implicit_replication():  # replicated parameters are plain beside DTensors (docs/guide.md)
        optimizer.step()
    with later:
        out["step1_max_diff"] = compare_tensors(model.named_parameters(), job.golden.after_step,
                                                get_shard_state(model), "after a step,")
    sw.save(model, run.folder / "model-step1", distributed=True)
    sw.save_optimizer(model, optimizer, run.folder / "optim-step1")

    target = _next_layout(job, run)
    out["reshard_to"] = target.name
    resumed, _ = place(job, target, run.folder / "model-step1")
    state = get_shard_state(resumed)
    optimizer = optimizer_for(resumed.parameters())
    sw.load_optimizer(resumed, optimizer, run.folder / "optim-step1")
    names = dict(resumed.named_parameters())
    with later:
        for key in ("exp_avg", "exp_avg_sq"):
            compare_tensors(((n, optimizer.state[p][key]) for n, p in names.items()),
                            {n: s[key] for n, s in job.golden.optim_state.items()}, state, f"AdamW {key} of")
        steps = {float(s["step"]) for s in optimizer.state.values()}
        if steps != {1.0}:
            raise Mismatch(f"AdamW step counts after load_optimizer are {sorted(steps)}, expected [1.0]")
    ids, targets = _to_device(job, *batch(1))
    loss_of(resumed(ids), targets).backward()
    sw.clip_grad_norm_(resumed, MAX_NORM)
    with implicit_replication():  # replicated parameters are plain beside DTensors (docs/guide.md)
        optimizer.step()
    with later:
        out["step2_max_diff"] = compare_tensors(resumed.named_parameters(), job.golden.after_two_steps, state,
                                                f"after the second step at {target.name},")
    later.raise_first()
    return out


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: Callable[[Job, Run], dict]
    needs: tuple[str, ...] = ()
    applies: Callable[[Layout], bool] = lambda layout: True
    judge: Callable[[Job, Layout, list[dict]], str | None] | None = None


SCENARIOS = (
    Scenario("load", load, judge=judge_load),
    Scenario("forward_backward", forward_backward, needs=("load",)),
    Scenario("clip_grad_norm", clip_grad_norm, needs=("forward_backward",)),
    Scenario("gather_save", gather_save, needs=("load",)),
    Scenario("dcp_reshard", dcp_reshard, needs=("load",)),
    Scenario("replicas_read_once", replicas_read_once, needs=("load",),
             applies=lambda layout: layout.has("dp_replicate"), judge=judge_replicas),
    Scenario("optimizer_reshard", optimizer_reshard, needs=("clip_grad_norm",)),
)

__all__ = ["SCENARIOS", "Job", "Layout", "Run", "Scenario", "Unsupported", "layout_limit", "layouts_for",
           "place"]
