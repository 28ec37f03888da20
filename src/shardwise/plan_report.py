"""What :func:`shardwise.check_plan` found: one ``Row`` per module call, the ``PlanReport`` that
prints them as a table, and the hint at a likely cause (``likely_cause``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from torch import nn

from shardwise.core.plan_rules import HEAD_ATTRS


@dataclass(frozen=True)
class Row:
    """One call of one module: the largest relative error of its inputs and outputs (sharded run
    against the one-process run, over every rank), its output's largest absolute error, how the
    output was laid out on the ranks and the style the plan gives the module ("" when none)."""

    path: str
    call: int
    input_rel: float
    output_abs: float
    output_rel: float
    layout: str
    style: str = ""
    note: str = ""  # a shape that no layout explains

    @property
    def name(self) -> str:
        return (self.path or "<model>") + (f" #{self.call}" if self.call else "")


@dataclass(frozen=True)
class PlanReport:
    """The outcome of :func:`shardwise.check_plan`, the same on every rank.

    ``ok``: the sharded forward equals the one-process forward (within ``rtol``) at every module;
    ``first_divergence``: the first module (execution order) whose output differs while its
    inputs agree, or the module a static check refused or the sharded forward failed in (None
    when ok); ``likely_cause``: the planned module the hint names, if any; ``hint``: a sentence;
    ``refusal``: the error's text when no forward ran or it raised; ``rows``: every module call."""

    ok: bool
    first_divergence: str | None
    rows: tuple[Row, ...] = ()
    hint: str = ""
    likely_cause: str | None = None
    refusal: str = ""
    rtol: float = 0.0
    mesh: str = ""

    def __str__(self) -> str:
        head = (f"check_plan ({self.mesh}, rtol {self.rtol:g}): "
                + ("OK, every module agrees with one process" if self.ok
                   else f"FAIL at {self.first_divergence!r}"))
        lines = [head]
        if self.refusal:
            lines.append(f"  refused: {self.refusal}")
        if self.rows:
            lines.extend(_table(self.rows, self.rtol, self.first_divergence))
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


def _table(rows: tuple[Row, ...], rtol: float, first: str | None, *, limit: int = 40) -> list[str]:
    """The rows as text; past ``limit`` rows, those around the first divergence and the last."""
    shown: list[Row | None] = list(rows)
    if len(rows) > limit:
        at = next((i for i, r in enumerate(rows) if r.path == first), len(rows) - 1)
        keep = set(range(max(0, at - limit // 2), min(len(rows), at + 5))) | {len(rows) - 1}
        shown = [r if i in keep else None for i, r in enumerate(rows)]
    cells = [("module", "style", "output layout", "in rel", "out abs", "out rel", "")]
    skipped = marked = False
    for r in shown:
        if r is None:
            if not skipped:
                cells.append(("...", "", "", "", "", "", ""))
            skipped = True
            continue
        skipped = False
        verdict = "ok" if r.output_rel <= rtol and r.input_rel <= rtol and not r.note else (
            "" if r.input_rel > rtol else "<- FIRST DIVERGENCE" if r.path == first and not marked
            else "<- diverges")
        marked = marked or verdict == "<- FIRST DIVERGENCE"
        cells.append((r.name, r.style, r.layout, _num(r.input_rel), _num(r.output_abs), _num(r.output_rel),
                      verdict + (f" ({r.note})" if r.note else "")))
    widths = [max(len(c[i]) for c in cells) for i in range(6)]
    return [("  " + "  ".join(c[i].ljust(widths[i]) for i in range(6)) + "  " + c[6]).rstrip() for c in cells]


def _num(x: float) -> str:
    return "-" if x != x else "inf" if math.isinf(x) else f"{x:.1e}"  # x != x: NaN, nothing compared


# -- the hint ----------------------------------------------------------------------------------

def module_in(message: str, model: nn.Module) -> str | None:
    """The first quoted module path (or plan key, ``*`` read as 0) in an error ``message`` that
    names a module of ``model``."""
    paths = {n for n, _ in model.named_modules() if n}
    quoted = [q.replace("*", "0") for q in re.findall(r"'([^' ]+)'", message)]  # a key: its first layer's
    return next((q for q in quoted if q in paths), None)


def hint_for(model: nn.Module, first: Row, rows: list[Row], styles: dict, blocks: dict,
             rtol: float) -> tuple[str, str | None]:
    """``(hint, likely cause)`` for the first diverging call ``first``: a planned module that
    does not compute its style, or, inside an unplanned one, the planned descendants whose
    outputs agree while the next one's inputs do not (a packed projection sliced plainly or
    with wrong proportions, a head count fixed in the forward)."""
    name = first.path or "the model"
    if not first.path and first.note:  # the model's output itself is a shard
        split_out = [r for r in rows if r.path in styles and r.layout != "whole"]
        cause = split_out[-1].path if split_out else None
        return (f"{first.note}: {cause!r} is planned {styles.get(cause, '')} and nothing gathers its "
                "output; colwise_gather_output (colwise_rep)?" if cause else first.note, cause)
    if first.path in styles:
        return (f"inputs agree, output differs at {name!r}, planned {styles[first.path]}: the module "
                "does not compute what that style assumes (colwise and rowwise swapped?)", first.path)
    scope = first.path
    while True:  # the diverging module, else its parent, ... : the planned modules that fed it
        inside = [r for r in rows[:rows.index(first)] if r.path in styles
                  and (r.path.startswith(scope + ".") or not scope)]
        bad_input = next((r for r in inside if r.input_rel > rtol), None)
        before = inside[:inside.index(bad_input)] if bad_input else inside
        producers = [r for r in before if _splits_output(styles[r.path])]
        if producers or not scope:
            break
        scope = scope.rpartition(".")[0]
    where = (f"its planned parts {', '.join(r.path.rpartition('.')[2] for r in before)} agree, but "
             f"{bad_input.path!r} gets different inputs" if bad_input and before else "")
    later = [r for r in rows[rows.index(first):] if r.path in styles and not _splits_output(styles[r.path])
             and (r.path.startswith(scope + ".") or not scope)]
    consumer = bad_input.path if bad_input else later[0].path if later else None
    swapped = [r for r in before if styles[r.path].startswith("rowwise") and r.layout == "whole"]
    if producers and swapped:  # a rowwise part beside colwise ones: whole where they return shards
        r, split = swapped[0], [p.path.rpartition(".")[2] for p in producers]
        return (f"inputs agree, output differs after {name!r}" + (f": {where}" if where else "")
                + f". {r.path!r} is planned {styles[r.path]} and returns the whole output, while "
                f"{', '.join(split)} return{'s' if len(split) == 1 else ''} shards that the code combines "
                "with it: colwise and rowwise swapped?", r.path)
    for r in reversed(producers):
        proposal = _packed_guess(model, r.path.rpartition(".")[0], r.path, consumer, blocks.get(r.path))
        if proposal:
            planned = styles[r.path]
            return (f"inputs agree, output differs after {name!r}" + (f": {where}" if where else "")
                    + f". {r.path!r} looks packed but the plan slices it as {planned}; {proposal}?",
                    r.path)
    fix = ("the forward between them does not follow the split: a head count fixed in the code? "
           "(view(b, t, -1, head_dim) infers the local one)")
    return (f"inputs agree, output differs after {name!r}" + (f": {where}; " if where else "; ")
            + fix, producers[-1].path if producers else None)


def _splits_output(style: str) -> bool:
    return style.startswith(("colwise", "PackedColwise", "packed_col")) and "gather" not in style and \
        "rep" not in style


def failure_hint(failing: str, rows: list[Row], styles: dict, split_params: dict[str, str], *,
                 whole_input: bool = False) -> tuple[str, str | None, str]:
    """``(hint, likely cause, module to blame)`` when the sharded forward raised in ``failing``
    before any output diverged. A rowwise module that failed on its whole one-process input
    (``whole_input``): its own style. A planned module that failed after split siblings: its
    parent's code between them; one that failed first: its own style. Else the planned module inside
    ``failing`` whose layout is the odd one out (a shard its consumer met whole, or whole among
    shards), else the last planned one that ran inside it."""
    if failing in styles:
        parent = failing.rpartition(".")[0]
        fed = [r.path for r in rows if r.path in styles and _splits_output(styles[r.path])
               and r.path.rpartition(".")[0] == parent]
        if whole_input and styles[failing].startswith("rowwise") and "split" not in styles[failing]:
            siblings = ", ".join(p.rpartition(".")[2] for p in fed)
            return (f"{failing!r} is planned {styles[failing]}, which takes a shard of its input features, "
                    "but it got the whole input (the one-process one)"
                    + (f", as its sibling(s) {siblings} do" if fed else "")
                    + ": colwise and rowwise swapped? (or rowwise_split_input to slice the whole input)",
                    failing, failing)
        mixed = _whole_among_shards(rows, styles, parent)
        if fed and mixed:  # the parent's code combined a whole output with shards, then failed here
            split = ", ".join(p.rpartition(".")[2] for p in fed)
            return (f"{mixed[0].path!r}, planned {styles[mixed[0].path]}, returns a whole tensor while its "
                    f"sibling(s) {split} return shards, and the code of {parent!r} combined them before "
                    f"{failing!r} failed: colwise and rowwise swapped?", mixed[0].path, parent)
        if fed:  # split siblings ran first: the parent's code between them and this one broke
            return (f"{failing!r} ({styles[failing]}) got an input it cannot take after its split sibling(s) "
                    f"{', '.join(p.rpartition('.')[2] for p in fed)} ran: the code of {parent!r} between "
                    "them does not follow the split: a head count fixed in the code (or read from the "
                    "config), or packed proportions it slices by?", fed[-1], parent)
        return (f"{failing!r} itself failed under its planned style {styles[failing]}: the style does not "
                "fit the input it gets (colwise and rowwise swapped?)", failing, failing)
    own = [f"{n.rpartition('.')[2]} ({style})" for n, style in split_params.items()
           if n.rpartition(".")[0] == failing]
    if own and failing not in styles:
        return (f"the plan splits {failing!r}'s parameters {', '.join(own)} but gives the module no style "
                "that makes its forward work on the shards (ep_dispatch_experts or moe_tp_experts for "
                "experts?)", failing, failing)
    scope = failing
    inside = [r for r in rows if r.path in styles and (r.path.startswith(scope + ".") or not scope)]
    while not inside and scope:  # nothing planned ran inside: the planned modules that fed it
        scope = scope.rpartition(".")[0]
        inside = [r for r in rows if r.path in styles and (r.path.startswith(scope + ".") or not scope)]
    split_out = [r for r in inside if r.layout != "whole"]
    whole_out = [r for r in inside if r.layout == "whole"]
    # siblings that disagree on the layout: among the failing code's own parts, one that slices a
    # whole input and returns a whole output beside shards (a swap), else the odd one out
    mixed = _whole_among_shards(rows, styles, failing)
    odd = whole_out if split_out and 0 < len(whole_out) < len(split_out) else split_out
    pick = mixed[0] if mixed else odd[-1] if odd else inside[-1] if inside else None
    if pick is None:
        return f"no planned module ran inside {failing or 'the model'!r} before it failed", None, failing
    what = (f"returns a shard ({pick.layout})" if pick in split_out
            else "returns a whole tensor (its siblings shards" + (
                ": colwise and rowwise swapped?)" if mixed else ")"))
    return (f"{pick.path!r}, planned {styles[pick.path]}, {what} that the code of {failing or 'the model'!r} "
            "cannot use as it is: a style that does not fit how the module's output is used?", pick.path,
            failing)


def _whole_among_shards(rows: list[Row], styles: dict, parent: str) -> list[Row]:
    """The children of ``parent`` planned to slice a whole input and return a whole output
    (``rowwise_split_input``) when other children return shards: colwise and rowwise swapped."""
    own = [r for r in rows if r.path in styles and r.path.rpartition(".")[0] == parent]
    if not any(r.layout != "whole" for r in own):
        return []
    return [r for r in own if r.layout == "whole" and styles[r.path].startswith("rowwise_split")]


def _packed_guess(model: nn.Module, owner: str, producer: str, consumer: str | None,
                  planned: tuple[int, ...] | None) -> str:
    """``"PackedColwise([..])"`` when ``producer``'s output looks packed in other proportions
    than ``planned``: its module's own ``_tp_packed_col_blocks``, q|k|v widths from the owner's
    head counts, or (without head counts) a whole multiple of the consumer's input width."""
    module = model.get_submodule(producer)
    out = getattr(module, "out_features", None)
    guess = getattr(module, "_tp_packed_col_blocks", None)
    attention = "qkv" in producer.rpartition(".")[2]
    if guess is None and out and attention:
        guess = _qkv_blocks(model.get_submodule(owner), out)
    if guess is None and out and consumer is not None:
        width = getattr(model.get_submodule(consumer), "in_features", None)
        if width and out % width == 0 and out // width > 1:
            guess = [1] * (out // width)
    if guess is None and out and not attention:
        guess = _qkv_blocks(model.get_submodule(owner), out)
    if guess is None:
        return ""
    g = math.gcd(*guess)
    guess = tuple(b // g for b in guess)
    return "" if guess == tuple(planned or (1,)) else f"PackedColwise({list(guess)})"


def _qkv_blocks(owner: nn.Module, width: int) -> list[int] | None:
    """``[heads, kv_heads, kv_heads]`` when ``width`` is a fused q|k|v of ``owner``'s head counts."""
    found: dict[str, int] = {}
    for src in (owner, getattr(owner, "config", None)):
        for attr in HEAD_ATTRS:
            value = getattr(src, attr, None) if src is not None else None
            if isinstance(value, int) and value > 0:
                found.setdefault("kv" if "kv" in attr or "key_value" in attr else "q", value)
    if "q" not in found:
        return None
    heads = found["q"]
    kv = found.get("kv", heads)
    return [heads, kv, kv] if width % (heads + 2 * kv) == 0 else None


__all__ = ["PlanReport", "Row", "failure_hint", "hint_for", "module_in"]
