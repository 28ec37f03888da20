"""``sw.load``: stream a safetensors checkpoint into a tensor-parallel model.

Every rank reads only the bytes of its own regions of each tensor (the whole tensor when it
is replicated), casts after slicing, moves the result to its device and installs it with
:func:`shardwise.parallel.install`, so the forward is wired exactly as ``parallelize`` wires
it. No collective runs: every rank plans and reads on its own. Guards, the plan, the
checkpoint headers and the key/shape checks all come before the first tensor byte is read.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardwise._progress import Progress
from shardwise.core.pieces import piece_reads
from shardwise.core.plan import ResolvedPlan
from shardwise.core.spec import local_layout, local_shape, split
from shardwise.errors import CheckpointError, PlanError, UsageError
from shardwise.io.checkpoint import Checkpoint, resolve_checkpoint
from shardwise.io.guards import check_mesh, check_model, check_options
from shardwise.io.hf_dcp import is_sharded_safetensors
from shardwise.io.hub_layout import Composite, hub_tensors
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

_SHOW = 20  # names listed in an error before "... and N more"


@dataclass(frozen=True)
class LoadResult:
    """What one rank's ``sw.load`` did.

    ``missing_keys``: model tensors the checkpoint lacks (non-strict loads only);
    ``unexpected_keys``: checkpoint tensors the model has no place for; ``bytes_read``:
    tensor bytes this rank read from disk; ``seconds``: wall time of the call on this rank;
    ``tensors``: how many tensors were read; ``unused_plan_keys``: plan keys that matched
    nothing in this model (skipped, as transformers skips them).
    """

    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    bytes_read: int
    seconds: float
    tensors: int
    unused_plan_keys: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (f"LoadResult(tensors={self.tensors}, bytes_read={self.bytes_read}, "
                f"seconds={self.seconds:.3f}, missing={len(self.missing_keys)}, "
                f"unexpected={len(self.unexpected_keys)})")


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
        from shardwise.io.spmd import load_spmd

        return load_spmd(model, path, specs=specs, mesh=mesh, dtype=dtype, strict=strict,
                         num_threads=_num_threads(num_threads), start=start)
    coords = mesh_coords(mesh)
    if (Path(path) / ".metadata").is_file() or any(Path(path).glob("*.distcp")):  # DCP, maybe incomplete
        return _load_dcp(model, path, specs=specs, mesh=mesh, holding=holding, dtype=dtype, strict=strict)
    if is_sharded_safetensors(path):  # rank-local safetensors with DCP_SHARDING_INFO (torch, transformers)
        from shardwise.io.hf_dcp_read import load_sharded_safetensors

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

    with Progress(sum(i.nbytes for i in items), progress, _is_rank0(), "shardwise load") as bar, \
            RegionReader(ckpt.headers, num_threads=_num_threads(num_threads), on_bytes=bar,
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


def match_keys(model: nn.Module, specs: ResolvedPlan, ckpt: Checkpoint, *, strict: bool):
    """``({name: (file, entry) or Composite}, missing, unexpected)`` for the model tensors
    in ``specs``.

    A tied tensor may be stored under any of its names; a tensor stored in its hub layout
    (transformers' conversion mapping) is a ``Composite`` of stored tensors. Raises ``CheckpointError`` for a
    shape that disagrees with the model and, when ``strict``, for missing keys.
    """
    names_of: dict[str, list[str]] = {name: [name] for name in specs}
    for alias, kept in specs.aliases.items():
        names_of[kept].append(alias)
    stored = set(ckpt.names)
    state = model.state_dict(keep_vars=True)
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    absent = {n for n, candidates in names_of.items() if not any(c in stored for c in candidates)}
    # A tensor the checkpoint stores in its hub layout (renamed, or split per expert).
    hub, used = hub_tensors(model, {k: ckpt.entry(k) for k in ckpt.names}, absent) if absent else ({}, set())
    sources, missing = {}, []
    for name, candidates in names_of.items():
        found = next((c for c in candidates if c in stored), None)
        if found is None and name in hub:
            composite = hub[name]
            if composite.shape != shapes[name]:
                raise CheckpointError(
                    f"{ckpt.root}: {name!r} assembles to shape {composite.shape} from the checkpoint's "
                    f"{len(composite.stored)} stored tensor(s) but is {shapes[name]} in the model; load "
                    "a checkpoint of this model's configuration")
            check_dtype(name, composite.entry.torch_dtype, state[name].dtype, where=ckpt.root)
            sources[name] = composite
            continue
        if found is None:
            missing.append(name)
            continue
        file, entry = ckpt.entry(found)
        if entry.shape != shapes[name]:
            raise CheckpointError(
                f"{file}: tensor {found!r} has shape {entry.shape} in the checkpoint but "
                f"{shapes[name]} in the model; load a checkpoint of this model's configuration"
            )
        check_dtype(found, entry.torch_dtype, state[name].dtype, where=file)
        sources[name] = (file, entry)
    unexpected = sorted(stored - set(shapes) - used)
    if missing and strict:
        raise CheckpointError(
            f"{ckpt.root}: {len(missing)} model tensor(s) missing from the checkpoint: "
            f"{_listing(missing)}; load the checkpoint that matches this model, or pass "
            "strict=False to keep the model's own values for them"
        )
    return sources, missing, unexpected


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


def check_dtype(name: str, stored: torch.dtype, declared: torch.dtype, *, where) -> None:
    """Raise ``CheckpointError`` unless a tensor stored as ``stored`` can fill a model tensor
    declared ``declared``: floating point to floating point (cast after slicing), anything
    else only to its own dtype, so no integer or bool is ever reinterpreted or narrowed."""
    if stored == declared or (stored.is_floating_point and declared.is_floating_point):
        return
    raise CheckpointError(
        f"{where}: tensor {name!r} is stored as {stored} but the model declares {declared}; "
        "a checkpoint of another model or a corrupted header? Load the checkpoint written for "
        "this model, or convert that tensor to the declared dtype first"
    )


def check_nothing_left_on_meta(model: nn.Module, specs: ResolvedPlan, missing: list[str]) -> None:
    """Raise before reading if the load would leave a tensor on the meta device."""
    state = model.state_dict(keep_vars=True)
    empty = [n for n in missing if state[n].is_meta]
    if empty:
        raise CheckpointError(
            f"{len(empty)} tensor(s) missing from the checkpoint have no value in the model (meta "
            f"device): {_listing(empty)}; load a checkpoint that has them, or build the model with "
            "these tensors materialised"
        )
    for name, buf in model.named_buffers():
        if name not in state and buf.is_meta:
            raise CheckpointError(
                f"non-persistent buffer {name!r} is on the meta device; checkpoints never store "
                "non-persistent buffers, so loading cannot fill it. Build the model inside "
                "`with sw.empty_model():` (parameters on meta, buffers real) instead of "
                "`with torch.device('meta'):`, or use sw.from_pretrained for Hugging Face models"
            )


def move_non_persistent(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a tensor outside the state dict (a custom state_dict hook hides it)
        raise CheckpointError(
            f"after loading, {_listing(left)} are still on the meta device: the model's state_dict "
            "does not list them, so no checkpoint can fill them; materialise them before sw.load"
        )


def _load_dcp(model, path, **kwargs):
    try:
        from shardwise.io.dcp import load_dcp
    except ImportError as e:
        raise CheckpointError(
            f"{path}: a torch distributed checkpoint (it has .metadata), but this shardwise "
            f"cannot read DCP checkpoints ({e}); consolidate it to safetensors first"
        ) from e
    return load_dcp(model, path, **kwargs)


def device_of(tp_mesh) -> torch.device:
    from shardwise.backends import current_backend

    backend = current_backend()
    if backend is not None:
        return torch.device(backend.device)
    return torch.device(tp_mesh.device_type)


def _num_threads(num_threads: int | None) -> int:
    if num_threads is not None:
        return num_threads
    # The ranks on this host share its cores (torchrun and sw.launch set LOCAL_WORLD_SIZE).
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, min(8, (os.cpu_count() or 1) // local_ranks))


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return shown + (f", ... and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


__all__ = [
    "LoadResult", "check_dtype", "check_nothing_left_on_meta", "device_of", "load", "match_keys",
    "move_non_persistent",
]
