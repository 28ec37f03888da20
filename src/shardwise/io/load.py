"""``sw.load``: its guards, the plan, then one format loader; and the safetensors one.

``load`` is the dispatcher: every holding and format goes through its guards and the
resolved plan, then to the loader of the checkpoint's format: torch DCP
(``shardwise.io.dcp``), rank-local sharded safetensors (``shardwise.io.hf_dcp_read``), one
process driving every device (``shardwise.io.spmd``), or ordinary safetensors (here). What
those loaders share (key matching, the meta checks, ``LoadResult``) is
``shardwise.io.pipeline``; the cast rule and the host-to-device copy ``shardwise.io.staging``.

The safetensors load: every rank reads only the bytes of its own regions of each tensor
(the whole tensor when it is replicated), casts after slicing, moves the result to its device
and installs it with :func:`shardwise.parallel.install`, so the forward is wired exactly as
``parallelize`` wires it. No collective runs: every rank plans and reads on its own. Guards,
the plan, the checkpoint headers and the key/shape checks all come before the first tensor
byte is read.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn

from shardwise._progress import Progress
from shardwise.core.pieces import piece_reads
from shardwise.core.plan import ResolvedPlan
from shardwise.core.spec import local_layout, local_shape, split
from shardwise.errors import CheckpointError, PlanError, UsageError
from shardwise.io.checkpoint import resolve_checkpoint
from shardwise.io.detect import is_dcp
from shardwise.io.guards import check_mesh, check_model, check_options
from shardwise.io.hf_dcp import is_sharded_safetensors
from shardwise.io.hf_dcp_read import load_sharded_safetensors
from shardwise.io.hub_layout import Composite
from shardwise.io.pipeline import (
    LoadResult,
    check_dtype,
    check_nothing_left_on_meta,
    device_of,
    is_rank0,
    match_keys,
    move_non_persistent,
    reader_threads,
)
from shardwise.io.reader import ReadItem, RegionReader, cpu_views, plan_reads
from shardwise.io.replicas import read_once, replica_axis
from shardwise.io.staging import finalizer
from shardwise.parallel import (
    HOLDINGS,
    check_spmd,
    check_wiring,
    default_holding,
    get_shard_state,
    install,
    mesh_coords,
    resolve_for_mesh,
    tp_axis,
)


def load(model: nn.Module, path: str | os.PathLike, *, plan, mesh, dtype: torch.dtype | None = None,
         strict: bool = True, num_threads: int | None = None, progress: bool | None = None,
         holding: str | None = None, ep_plan=None, **options) -> LoadResult:
    """Fill ``model`` (usually built on the meta device) from the checkpoint at ``path``,
    sharded by ``plan`` over the tp axis of ``mesh``; every rank of the mesh calls it.

    ``plan`` is a dict of module or parameter paths to styles (transformers' and diffusers'
    plans as they ship), or ``"auto"`` for the model's own plan; keys that match nothing
    in this model are skipped, warned about once and listed in the result. On a mesh with
    an ``ep`` axis (``backend.mesh(ep=2)``, ``backend.mesh(ep=2, tp=2)``) the experts are
    split over it by ``ep_plan`` (default: the model's own ``base_model_ep_plan``), and a
    rank reads only its own experts' bytes.
    ``path`` is a ``.safetensors`` file, a ``*.safetensors.index.json`` (any prefix), a
    folder holding one of them, or a torch DCP folder (with ``.metadata``). ``dtype`` casts
    floating-point tensors after slicing (``None`` keeps the file's dtypes). ``strict``
    raises on missing keys; a shape that disagrees with the model always raises.
    ``num_threads`` read in parallel (default ``min(8, cpus / ranks on this host)``);
    ``progress`` shows a bar on rank 0 (default: when stderr is a terminal and tqdm is
    installed). ``holding`` is ``"dtensor"`` or ``"local"`` (default: the backend's).
    Unknown keyword options raise ``TypeError``; ``device_map`` and other placement
    options of ``from_pretrained`` raise ``UnsupportedModelError`` (they cannot stream).

    >>> with torch.device("meta"):                                          # doctest: +SKIP
    ...     model = MyModel(config)
    >>> sw.load(model, "ckpt/", plan=plan, mesh=backend.mesh(tp=4), dtype=torch.bfloat16)  # doctest: +SKIP
    LoadResult(tensors=291, bytes_read=4021813248, seconds=1.912, missing=0, unexpected=0)
    """
    start = time.perf_counter()
    check_options(_where="load", **options)
    check_model(model, action="load")
    check_mesh(mesh)
    if get_shard_state(model) is not None:
        raise PlanError("model is already parallelised; build a fresh (meta) model to load into")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    holding = holding or default_holding()
    if holding not in HOLDINGS:
        raise UsageError(f"holding must be one of {HOLDINGS} or None (the backend's), got {holding!r}")
    tp_mesh = tp_axis(mesh)
    check_spmd(tp_mesh, holding)
    specs = resolve_for_mesh(model, plan, mesh, ep_plan)
    check_wiring(model, specs, holding)
    if holding == "spmd":  # one process drives every device: tensors are built on them
        # imported on use: it pulls torch.distributed.checkpoint (its DCP reads), ~0.5 s to import
        from shardwise.io.spmd import load_spmd

        return load_spmd(model, path, specs=specs, mesh=mesh, dtype=dtype, strict=strict,
                         num_threads=reader_threads(num_threads), start=start)
    coords = mesh_coords(mesh)
    if is_dcp(path):  # DCP, maybe incomplete
        return _load_dcp(model, path, specs=specs, mesh=mesh, holding=holding, dtype=dtype, strict=strict)
    if is_sharded_safetensors(path):  # rank-local safetensors with DCP_SHARDING_INFO (torch, transformers)
        return load_sharded_safetensors(model, path, specs=specs, mesh=mesh, holding=holding, dtype=dtype,
                                        strict=strict, num_threads=num_threads, progress=progress)

    ckpt = resolve_checkpoint(path)
    sources, missing, unexpected = match_keys(model, specs, ckpt, strict=strict)
    check_nothing_left_on_meta(model, specs, missing)
    composites = {n: s for n, s in sources.items() if isinstance(s, Composite)}
    items = [item for axis, (d, r) in coords.items() for item in plan_reads(
        {n: s for n, s in sources.items() if n not in composites and specs[n].axis == axis}, specs, d, r)]
    assembler = Assembler(composites, specs, coords)
    items += assembler.items
    device = device_of(tp_mesh)
    finalize = finalizer(dtype, device)  # cast after slicing, then to the device

    with Progress(sum(i.nbytes for i in items), progress, is_rank0(), "shardwise load") as bar, \
            RegionReader(ckpt.headers, num_threads=reader_threads(num_threads), on_bytes=bar,
                         viewable=cpu_views(device, dtype)) as reader:
        def take(item, raw):
            return assembler.take(item, raw, finalize)

        if replica_axis(mesh) is None:
            tensors = reader.read(items, finalize=take)
        else:  # dp replicas: each region is read from storage by one of them and sent to the others
            whole = {n for n in sources if n not in composites and specs[n].replicated}
            tensors = read_once(reader, items, finalize=take, mesh=mesh, whole=whole, on_bytes=bar)
    tensors = {n: t for n, t in tensors.items() if t is not None} | assembler.done
    own = model.state_dict(keep_vars=True) if missing else {}

    def local_tensor(name, spec):
        if name in tensors:
            return tensors.pop(name)  # install owns it now; our reference goes
        return finalize(split(own[name].detach().cpu(), spec, *coords[spec.axis]))  # non-strict: keep own

    install(model, specs, mesh, holding=holding, local_tensor=local_tensor, dtype=dtype)
    move_non_persistent(model, device)
    return LoadResult(tuple(missing), tuple(unexpected), reader.bytes_read,
                      time.perf_counter() - start, len(items), specs.unused_keys)


class Assembler:
    """Reads of tensors made of several stored tensors (hub layouts), and their assembly.

    ``items`` are one :class:`ReadItem` per overlap of this rank's regions with a stored
    tensor (:func:`shardwise.core.spec.piece_reads`); :meth:`take` copies each read box
    into its place in the local shard and finalizes the shard when its last box arrives.
    """

    def __init__(self, composites: dict, specs: ResolvedPlan, coords: dict[str, tuple[int, int]]):
        self.items: list[ReadItem] = []
        self.done: dict[str, torch.Tensor] = {}
        self._place: dict[str, tuple[str, tuple[slice, ...]]] = {}
        self._pending: dict[str, list] = {}  # name -> [buffer or None, reads left, shape, dtype]
        self._lock = threading.Lock()
        for name, comp in composites.items():
            spec = specs[name]
            degree, rank = coords[spec.axis]
            shape = local_shape(comp.shape, spec, degree)
            reads = piece_reads(local_layout(comp.shape, spec, degree, rank), comp.pieces)
            self._pending[name] = [None, len(reads), shape, comp.entry.torch_dtype]
            if not reads:  # an empty tensor: nothing to read
                self.done[name] = torch.empty(shape, dtype=comp.entry.torch_dtype)
            for i, (piece, src, off) in enumerate(reads):
                path, entry = comp.stored[piece.key]
                it = iter(src.sizes)
                box = [1 if d in piece.stacked else next(it) for d in range(len(off))]
                item = ReadItem(f"{name}#{i}", path, entry, [(src, (0,) * len(src.sizes))], src.sizes)
                self.items.append(item)
                self._place[item.name] = (name, tuple(slice(o, o + n) for o, n in zip(off, box, strict=True)))

    def take(self, item: ReadItem, raw: torch.Tensor, finalize):
        if item.name not in self._place:
            return finalize(raw)
        name, where = self._place.pop(item.name)
        with self._lock:
            state = self._pending[name]
            if state[0] is None:
                state[0] = torch.empty(state[2], dtype=state[3])
            buf = state[0]
        buf[where].copy_(raw.view(buf[where].shape))
        with self._lock:
            state[1] -= 1
            last = state[1] == 0
        if last:
            self.done[name] = finalize(self._pending.pop(name)[0])
        return None


def _load_dcp(model, path, **kwargs):
    try:  # imported on use: torch.distributed.checkpoint takes ~0.5 s to import
        from shardwise.io.dcp import load_dcp
    except ImportError as e:
        raise CheckpointError(
            f"{path}: a torch distributed checkpoint (it has .metadata), but this shardwise "
            f"cannot read DCP checkpoints ({e}); consolidate it to safetensors first"
        ) from e
    return load_dcp(model, path, **kwargs)


__all__ = [
    "LoadResult", "check_dtype", "check_nothing_left_on_meta", "device_of", "load", "match_keys",
    "move_non_persistent",
]
