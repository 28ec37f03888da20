"""Which module does a plan break? :func:`check_plan` shards a copy of a model, runs it and the
one-process model on the same inputs, and compares every module's inputs and outputs in
execution order (``shardwise.plan_report`` prints what it found)."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import torch
from torch import nn

import shardwise.comm as comm
from shardwise.core.plan import resolve_plan
from shardwise.core.spec import ShardSpec, check_shardable, split
from shardwise.errors import ShardwiseError, UsageError
from shardwise.holding import is_dtensor
from shardwise.mesh import get_shard_state
from shardwise.parallel import parallelize
from shardwise.plan_report import PlanReport, Row, failure_hint, hint_for, module_in

# the largest relative error (max |sharded - one process| / max |one process|) counted as equal:
# a few ulps of the dtype, times the reductions a tiny model sums in another order
NAN = float("nan")
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def check_plan(model: nn.Module, inputs: tuple = (), *, plan="auto", mesh, kwargs: Mapping | None = None,
               holding: str | None = None, ep_plan=None, rtol: float | None = None) -> PlanReport:
    """Shard a copy of ``model`` with ``plan`` on ``mesh``, run both on ``inputs`` (positional;
    ``kwargs`` keyword) in eval mode, and report the first module whose output differs while
    its inputs agree. ``model`` is a whole model with real weights, the same on every rank; it
    is not changed. Every rank calls it and gets the same report. A plan a static check refuses,
    or a sharded forward that raises, is reported (not raised) with the module it names.

    >>> report = sw.check_plan(model, (ids,), plan=plan, mesh=backend.mesh(tp=2))  # doctest: +SKIP
    >>> report.ok, report.first_divergence                                          # doctest: +SKIP
    (False, 'layers.0.mlp')
    >>> print(report)                                                               # doctest: +SKIP
    """
    if get_shard_state(model) is not None:
        raise UsageError("check_plan takes the whole one-process model, but this one is already "
                         "sharded; pass the model as built, before sw.parallelize or sw.load")
    kwargs = dict(kwargs or {})
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    rtol = RTOL.get(dtype, 1e-4) if rtol is None else rtol
    was_training = model.training
    sharded = copy.deepcopy(model).eval()
    try:
        reference, reference_counts, failed, _, _ = _record(model.eval(), inputs, kwargs)
    finally:
        model.train(was_training)
    if failed is not None:
        raise UsageError(f"check_plan: the one-process model's forward raised on these inputs "
                         f"({type(failed).__name__}: {failed}); fix the inputs or the model first"
                         ) from failed
    describe = f"mesh {dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=False))}"
    try:
        parallelize(sharded, plan, mesh, holding=holding, ep_plan=ep_plan)
    except ShardwiseError as e:  # a static refusal: the same on every rank
        names = mesh.mesh_dim_names or ()
        degree = mesh.size(names.index("tp")) if "tp" in names else 1
        named = module_in(str(e), model) or _unsplittable(model, plan, degree)
        return PlanReport(ok=False, first_divergence=named, likely_cause=named, rtol=rtol, mesh=describe,
                          refusal=f"{type(e).__name__}: {e}")
    state = get_shard_state(sharded)
    assert state is not None  # parallelize leaves it
    styles = {p: s.source or s.kind for p, s in state.specs.styles.items()}
    blocks = {p: s.blocks for p, s in state.specs.styles.items()}
    recorded, recorded_counts, error, failing, failing_in = _record(sharded, inputs, kwargs)
    # calls that pair with no one-process call: inside modules that run a rank's own experts,
    # or modules called another number of times
    apart = tuple(p + "." for p, s in state.specs.styles.items()
                  if s.forward in ("ep_experts", "moe_experts"))
    counts = reference_counts, recorded_counts
    rows = [Row(path, call, NAN, NAN, NAN, "not compared", styles.get(path, ""))
            if path.startswith(apart) or counts[0].get(path) != counts[1].get(path)
            else _compare(path, call, seen, reference.get((path, call)), state)
            for (path, call), seen in recorded.items()]
    # one collective, whatever each rank's forward did: a rank that raised still reports
    # a failing module whose inputs are the one-process ones, whole: its own style does not fit them
    if error is not None:
        want = reference.get((failing, counts[1].get(failing, 0)), ((), ()))[0]
        whole_in = len(want) == len(failing_in) > 0 and all(
            a.shape == b.shape and _diff(a, b)[1] <= rtol for a, b in zip(failing_in, want, strict=True))
    rows, raised = _over_ranks(rows, None if error is None
                               else (failing, f"{type(error).__name__}: {error}", whole_in))
    first = next((r for r in rows if r.input_rel <= rtol and (r.output_rel > rtol or r.note)), None)
    if raised is not None:
        failing = raised[0]
        failed = f"the sharded forward raised in {failing!r}: {raised[1]}"
        if first is not None:
            hint, cause = hint_for(sharded, first, rows, styles, blocks, rtol)
        else:
            split_params = {n: f"plan key {state.specs.keys.get(n, '?')!r}" for n, spec in state.specs.items()
                            if not spec.replicated}
            hint, cause, failing = failure_hint(failing, rows, styles, split_params, whole_input=raised[2])
        return PlanReport(ok=False, first_divergence=first.path if first else failing, rows=tuple(rows),
                          hint=hint, likely_cause=cause, refusal=failed, rtol=rtol, mesh=describe)
    bad = [r for r in rows if r.output_rel > rtol or r.input_rel > rtol or r.note]
    if not bad:
        return PlanReport(ok=True, first_divergence=None, rows=tuple(rows), rtol=rtol, mesh=describe)
    first = first or bad[0]
    hint, cause = hint_for(sharded, first, rows, styles, blocks, rtol)
    return PlanReport(ok=False, first_divergence=cause if first.path == "" and cause else first.path,
                      rows=tuple(rows), hint=hint, likely_cause=cause, rtol=rtol, mesh=describe)


def _unsplittable(model: nn.Module, plan, degree: int) -> str | None:
    """The module of the first tensor whose planned split its shape cannot hold (a refusal whose
    text names a shape, not a module)."""
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    try:
        specs = resolve_plan(model, plan, degree)
    except ShardwiseError as e:  # refused while resolving: the key whose packed ratios it names
        modules = dict(model.named_modules())
        for key, style in plan.items() if isinstance(plan, Mapping) else ():
            blocks = getattr(style, "blocks", None)
            if blocks and str(tuple(blocks)) in str(e) and key.replace("*", "0") in modules:
                return key.replace("*", "0")
        return None
    for name, spec in specs.items():
        try:
            if spec.axis == "tp":
                check_shardable(shapes[name], spec, degree)
        except ShardwiseError:
            return name.rpartition(".")[0]
    return None


def _record(model: nn.Module, inputs: tuple, kwargs: dict):
    """``(calls, counts, error, failing module, its inputs)``: every module call's flattened
    inputs and outputs, by ``(path, call)`` in the order calls end, each module's number of
    calls, the forward's exception (None), the innermost module it was in and that call's
    flattened inputs."""
    calls: dict = {}
    counts: dict[str, int] = {}
    opened: list[str] = []  # modules entered and not yet left (the failing one)
    opened_args: list = []  # their (args, kwargs)
    handles = []
    for path, module in model.named_modules():
        def pre(mod, args, kw, path=path):
            opened.append(path)
            opened_args.append((args, kw))  # kept as they are: flattened only for a failing call

        def post(mod, args, kw, out, path=path):
            opened.pop()
            opened_args.pop()
            n = counts.get(path, 0)
            counts[path] = n + 1
            calls[(path, n)] = (_flat((args, kw)), _flat(out))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    error = None
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    except Exception as e:  # a wrong plan's forward may fail anywhere: reported, not raised
        error = e
    finally:
        for h in handles:
            h.remove()
    # the failing call's inputs as this rank holds them: no collective where ranks may have failed apart
    failing_in = _flat(opened_args[-1], gather=False) if opened_args else []
    return calls, counts, error, opened[-1] if opened else "", failing_in


def _flat(value, *, gather: bool = True) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists, dicts, model outputs), detached copies;
    a DTensor as its full tensor (``gather``) or this rank's local one."""
    if isinstance(value, torch.Tensor):
        t = (value.full_tensor() if gather else value.to_local()) if is_dtensor(value) else value
        return [t.detach().clone()]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for v in value for t in _flat(v, gather=gather)]
    return []


def _compare(path: str, call: int, seen, want, state) -> Row:
    """The errors of one sharded call against its one-process call, each tensor compared in the
    layout the plan gives it (or, unplanned, the layout that fits best)."""
    style = state.specs.styles.get(path)
    name = (style.source or style.kind) if style else ""
    if want is None:
        return Row(path, call, float("nan"), float("inf"), float("inf"), "-", name,
                   "no such call in one process")
    (ins, outs), (ref_ins, ref_outs) = seen, want
    known_in = known_out = None
    weight = state.specs.get(f"{path}.weight") if path else None  # its blocks: the plan's or the module's
    blocks = weight.blocks if weight is not None and not weight.replicated else (1,)
    if style is not None and style.kind == "rowwise" and not (style.split_input or style.embedding):
        known_in = blocks
    if style is not None and style.kind == "colwise" and not (style.gather_output or style.embedding):
        known_out = blocks
    candidates = sorted({s.blocks for s in state.specs.values() if not s.replicated}, key=lambda b: b != (1,))
    in_rel = max([_error(a, b, state, known_in, candidates)[1] for a, b in zip(ins, ref_ins, strict=False)],
                 default=0.0)
    out_abs, out_rel, layout, note = 0.0, 0.0, "whole", ""
    if len(outs) != len(ref_outs) or len(ins) != len(ref_ins):
        note = f"{len(outs)} outputs, {len(ref_outs)} in one process"
    for a, b in zip(outs, ref_outs, strict=False):
        err_abs, err_rel, how = _error(a, b, state, known_out, candidates)
        if err_rel >= out_rel:
            out_abs, out_rel = max(out_abs, err_abs), err_rel
        if how != "whole":
            layout = how
        if err_rel == float("inf") and not note:
            note = f"shape {tuple(a.shape)}, one process {tuple(b.shape)}"
        elif how != "whole" and not path and not note:  # what the caller gets must be whole
            note = f"the model returns a shard ({how}), not the whole output"
    return Row(path, call, in_rel, out_abs, out_rel, layout, name, note)


def _error(local: torch.Tensor, full: torch.Tensor, state, known, candidates) -> tuple[float, float, str]:
    """``(max abs error, max relative error, layout)`` of ``local`` against ``full``: whole when
    the shapes agree, else this rank's shard of ``full`` along the one dim that is 1/degree as
    wide (blocks ``known``, or the best of ``candidates``); inf when no layout explains it."""
    if local.shape == full.shape:
        return (*_diff(local, full), "whole")
    if local.ndim != full.ndim:
        return float("inf"), float("inf"), "-"
    dims = [d for d in range(full.ndim) if local.shape[d] != full.shape[d]]
    best = (float("inf"), float("inf"), "-")
    for axis, (degree, rank) in state.axis_coords.items():
        if len(dims) != 1 or degree < 2 or full.shape[dims[0]] != local.shape[dims[0]] * degree:
            continue
        for blocks in [known] if known else candidates:
            spec = ShardSpec(dim=dims[0], blocks=blocks, axis=axis)
            try:
                check_shardable(tuple(full.shape), spec, degree)
            except ShardwiseError:  # blocks that do not fit this tensor: not its layout
                continue
            want = split(full, spec, degree, rank)
            shown = f"dim {dims[0] - full.ndim} / {degree} {axis}"
            shown += f" {[b // math.gcd(*blocks) for b in blocks]}" if blocks != (1,) else ""
            err = (*_diff(local, want), shown)
            if err[1] < best[1]:
                best = err
    return best


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    if not (a.is_floating_point() or a.is_complex()):
        return (0.0, 0.0) if torch.equal(a, b) else (float("inf"), float("inf"))
    a, b = a.double(), b.double()
    if a.numel() == 0:
        return 0.0, 0.0
    err = (a - b).abs().nan_to_num(nan=float("inf")).max().item()
    scale = b.abs().max().item()
    return err, err / max(scale, 1e-30) if err else 0.0


def _over_ranks(rows: list[Row], raised: tuple | None) -> tuple[list[Row], tuple | None]:
    """Each row's worst errors over every rank, in rank 0's order with rank 0's layout and style
    (then those only other ranks ran), and the first rank's ``(module, error, whole input)``
    where a sharded forward raised: the same on every rank."""
    every = comm.all_gather_object((rows, raised), purpose="check_plan's comparison")
    worst: dict = {}
    for rank_rows, _ in every:
        for r in rank_rows:
            w = worst.setdefault((r.path, r.call), r)
            worst[(r.path, r.call)] = Row(
                r.path, r.call, _worse(r.input_rel, w.input_rel), _worse(r.output_abs, w.output_abs),
                _worse(r.output_rel, w.output_rel), w.layout, w.style, w.note or r.note)
    return list(worst.values()), next((e for _, e in every if e is not None), None)


def _worse(a: float, b: float) -> float:
    return a if b != b or a > b else b  # b != b: NaN, nothing compared there


__all__ = ["RTOL", "check_plan"]
