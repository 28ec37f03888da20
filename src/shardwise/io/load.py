"""``sw.load``: one pipeline for every checkpoint format and holding. guards -> plan ->
``open_source`` (the format plugin that claims the path) -> ``match`` (keys, shapes, dtypes,
before any read) -> ``plan`` (this rank's reads) -> ``read`` (each tensor finalized as it arrives)
-> place (``io.place``). Every rank plans and reads on its own; the only collectives are DCP's,
the dp replicas' shared reads and the exchange of a storage read once per job."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from shardwise._progress import Progress
from shardwise.comm import agree, rank
from shardwise.core.plan import ResolvedPlan
from shardwise.core.walk import named_modules, one_walk, state_tensors, tensors_changed
from shardwise.errors import CheckpointError, PlanError, ShardwiseError, on_every_rank
from shardwise.io.formats import get_format, open_source
from shardwise.io.formats.safetensors.keys import listing
from shardwise.io.guards import check_mesh, check_model, check_options
from shardwise.io.place import placement
from shardwise.io.read.modes import read_mode
from shardwise.io.source import ReadMode, ReadOptions
from shardwise.io.storage import Location, locate
from shardwise.io.storage.lookups import one_look
from shardwise.mesh import decode_mesh
from shardwise.parallel import check_wiring, get_shard_state, resolve_for_mesh
from shardwise.quant import check_quantized_load, check_quantized_source, drop_quantization_config


@dataclass(frozen=True)
class LoadResult:
    """What one rank's ``sw.load`` did: ``missing_keys`` (non-strict loads only),
    ``unexpected_keys`` (checkpoint tensors the model has no place for), ``bytes_read`` (tensor
    bytes this rank read), ``seconds`` (its wall time), ``tensors`` (how many were read),
    ``unused_plan_keys`` (plan keys that matched nothing in this model, skipped)."""

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


def load(model: nn.Module, path: str | os.PathLike | Location, *, plan, mesh,
         dtype: torch.dtype | None = None, strict: bool = True, num_threads: int | None = None,
         progress: bool | None = None, holding: str | None = None, ep_plan=None, dequantize: bool = False,
         storage_options: dict | None = None, **options) -> LoadResult:
    """Fill ``model`` (usually built on the meta device) from the checkpoint at ``path``,
    sharded by ``plan`` over the tp axis of ``mesh``; every rank of the mesh calls it. A mesh
    without a tp axis holds the model whole, ready for ``fully_shard``.

    ``plan``: module or parameter paths to styles (transformers' and diffusers' plans as they
    ship), or ``"auto"`` for the model's own; keys that match nothing are skipped, warned about
    and listed in the result (none matching is a ``PlanError``). An ``ep`` mesh axis splits the
    experts by ``ep_plan`` (default: the model's ``base_model_ep_plan``). ``path``: a
    ``.safetensors`` file, a ``*.safetensors.index.json``, a folder holding one, or a torch DCP
    folder; local or a registered storage's URL (given ``storage_options``). ``dtype`` casts
    floating tensors after slicing (None: the file's dtypes). ``strict`` raises on missing keys;
    a shape that disagrees always raises. ``num_threads``: readers (default ``min(8, cpus / ranks
    on this host)``, or an object store's ``concurrency``). ``progress``: a tqdm bar on rank 0
    (default: when stderr is a terminal). ``holding``: ``"dtensor"`` or ``"local"`` (default: the
    backend's). Unknown options raise ``TypeError``; ``device_map`` and the other placement
    options of ``from_pretrained`` raise ``UnsupportedModelError`` (they cannot stream).

    FP8 block-scaled checkpoints: a model of ``FP8Linear`` modules stays quantized (each rank its
    weight shard and the scales of the blocks it touches; ``dtype`` leaves both); with
    ``dequantize=True`` a plain model gets its shard dequantized into ``dtype`` (or the declared
    dtype) and ``config.quantization_config`` is removed. An FP8 checkpoint into a plain model
    without ``dequantize=True`` raises ``CheckpointError``.

    >>> with torch.device("meta"):                                          # doctest: +SKIP
    ...     model = MyModel(config)
    >>> sw.load(model, "ckpt/", plan=plan, mesh=backend.mesh(tp=4), dtype=torch.bfloat16)  # doctest: +SKIP
    LoadResult(tensors=291, bytes_read=4021813248, seconds=1.912, missing=0, unexpected=0)
    """
    with collector_paused(), one_walk(model):  # the guards, plan, match, install and checks: one walk
        return _load(model, path, plan=plan, mesh=mesh, dtype=dtype, strict=strict, num_threads=num_threads,
                     progress=progress, holding=holding, ep_plan=ep_plan, dequantize=dequantize,
                     storage_options=storage_options, **options)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, back as it was after. A load makes
    objects per module (specs, styles, parameters, DTensors) and keeps them, and every full
    collection walks all of them: on a 64-expert x 32-layer MoE (8,614 modules) the collections
    were ~40% of the load. Cycles made meanwhile are collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(model: nn.Module, path, *, plan, mesh, dtype, strict, num_threads, progress, holding, ep_plan,
          dequantize, storage_options, **options) -> LoadResult:
    start = time.perf_counter()
    with on_every_rank():  # the same inputs on every rank, before any read or collective
        check_options(_where="load", **options)
        check_model(model, action="load")
        check_mesh(mesh)
        if get_shard_state(model) is not None:
            raise PlanError("model is already parallelised; build a fresh (meta) model to load into")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        dims = decode_mesh(mesh, holding)  # the API boundary: the mesh decoded once, passed down
        specs = resolve_for_mesh(model, plan, dims, ep_plan)
        check_wiring(model, specs, dims.holding)
        check_quantized_load(specs, dims.holding, dequantize)
        where = locate(path, storage_options)  # the location, decoded once

    # Who reads each region, decided here once for every format. Over a storage read once per
    # job the read is a collective (io.exchange; a DCP read always is): a rank that fails before
    # it tells its peers here, or they would wait in the read's first collective until the timeout.
    mode = read_mode(where.storage, dims)
    collective = mode is ReadMode.JOB
    with one_look():  # an object store's listings, HEADs and journal asked once in this load
        try:
            source = open_source(where, dequantize=dequantize)
            if specs.ties:  # quantized weights: the source's format must place their scales
                check_quantized_source(source, specs, mesh, get_format(source.name).CAPABILITIES)
            missing, unexpected = source.match(model, specs, strict=strict)
            check_nothing_left_on_meta(model, specs, missing)
            place = placement(model, specs, dims, dtype)
            names = [n for n in specs if n not in missing]
            reads = source.plan(place.wants(names))
        except Exception as e:
            if collective:  # marks it for one report when every rank failed alike
                agree(dims.comm_backend, e, what=f"opening {where}")
            elif isinstance(e, ShardwiseError):  # the same path, files and model on every rank
                e.every_rank = True  # type: ignore[attr-defined]
            raise
        if collective:
            agree(dims.comm_backend, None, what=f"opening {where}")
        how = ReadOptions(dtype, place.device, reader_threads(num_threads, where.storage), mode=mode,
                          window=place.window, backend=dims.comm_backend, mesh=dims)
        with Progress(reads.nbytes, progress, rank() == 0, "shardwise load (rank 0's slices)") as bar:
            tensors = source.read(reads, finalize=place.finalize, options=how, on_bytes=bar)
    place.install(model, tensors, missing)
    move_non_persistent(model, dims.device)
    tensors_changed(model)
    if dequantize:
        drop_quantization_config(model)
    return LoadResult(tuple(missing), tuple(unexpected), source.bytes_read,
                      time.perf_counter() - start, len(names), specs.unused_keys)


def check_nothing_left_on_meta(model: nn.Module, specs: ResolvedPlan, missing: list[str]) -> None:
    """Raise before reading if the load would leave a tensor on the meta device."""
    state = state_tensors(model)
    empty = [n for n in missing if state[n].is_meta]
    if empty:
        raise CheckpointError(
            f"{len(empty)} tensor(s) missing from the checkpoint have no value in the model (meta "
            f"device): {listing(empty)}; load a checkpoint that has them, or build the model with "
            "these tensors materialised"
        )
    for path, module in named_modules(model):
        for leaf, buf in module._buffers.items():
            name = f"{path}.{leaf}" if path else leaf
            if buf is not None and buf.is_meta and name not in state:
                raise CheckpointError(
                    f"non-persistent buffer {name!r} is on the meta device; checkpoints never store "
                    "non-persistent buffers, so loading cannot fill it. Build the model inside "
                    "`with sw.empty_model():` (parameters on meta, buffers real) instead of "
                    "`with torch.device('meta'):`, or use sw.from_pretrained for Hugging Face models"
                )


def move_non_persistent(model: nn.Module, device: torch.device) -> None:
    """Move the non-persistent buffers to ``device``; raise if any tensor is left on meta."""
    left: dict[str, None] = {}
    for path, module in named_modules(model):  # one walk: move, then look for meta tensors
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
        prefix = f"{path}." if path else ""
        for tensors in (module._parameters, module._buffers):
            left.update((prefix + n, None) for n, t in tensors.items() if t is not None and t.is_meta)
    if left:  # a tensor outside the state dict (a custom state_dict hook hides it)
        raise CheckpointError(
            f"after loading, {listing(list(left))} are still on the meta device: the model's state_dict "
            "does not list them, so no checkpoint can fill them; materialise them before sw.load"
        )



def reader_threads(asked: int | None, storage=None) -> int:
    """The reader threads of a load: ``asked``, else the requests in flight that ``storage``
    declares (``concurrency``: an object store, whose reads wait on the network, not on cores),
    else ``min(8, cpus / ranks on this host)``."""
    if asked is not None:
        return asked
    in_flight = getattr(storage, "concurrency", None)
    if isinstance(in_flight, int) and in_flight > 0:
        return in_flight
    # The ranks on this host share its cores (torchrun and sw.launch set LOCAL_WORLD_SIZE).
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, min(8, (os.cpu_count() or 1) // local_ranks))
__all__ = ["LoadResult", "check_nothing_left_on_meta", "load", "move_non_persistent"]
