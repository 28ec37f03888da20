"""``sw.load``: one pipeline for every checkpoint format and holding.

guards -> plan (``resolve_for_mesh``) -> ``shardwise.io.formats.open_source`` (the format
detected once, by the registry of format plugins) ->
``source.match`` (keys, shapes and dtypes against the model, before any data is read) ->
``source.plan`` (this rank's reads) -> ``source.read`` (finalized as they arrive: the cast
rule and the host-to-device copy of ``shardwise.io.staging``) -> place per holding
(``shardwise.io.place``: ``install`` for dtensor/local, built on the devices for spmd).

A format is a :class:`~shardwise.io.source.Source`: ordinary safetensors and hub layouts
(``shardwise.io.formats.safetensors``), rank-local sharded safetensors
(``shardwise.io.formats.sharded``), torch DCP (``shardwise.io.formats.dcp``). What the steps share
(key matching, the meta checks, ``LoadResult``) is ``shardwise.io.pipeline``. Every rank
plans and reads on its own; the only collectives are DCP's own and the dp replicas' sharing
of reads (``shardwise.io.replicas``).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from shardwise._progress import Progress
from shardwise.errors import PlanError, on_every_rank
from shardwise.io.formats import open_source
from shardwise.io.guards import check_mesh, check_model, check_options
from shardwise.io.pipeline import (
    LoadResult,
    check_dtype,
    check_nothing_left_on_meta,
    is_rank0,
    match_keys,
    move_non_persistent,
    reader_threads,
)
from shardwise.io.place import placement
from shardwise.io.source import ReadOptions
from shardwise.mesh import decode_mesh
from shardwise.parallel import check_wiring, get_shard_state, resolve_for_mesh
from shardwise.quant import check_quantized_load, check_quantized_source, drop_quantization_config


def load(model: nn.Module, path: str | os.PathLike, *, plan, mesh, dtype: torch.dtype | None = None,
         strict: bool = True, num_threads: int | None = None, progress: bool | None = None,
         holding: str | None = None, ep_plan=None, dequantize: bool = False, **options) -> LoadResult:
    """Fill ``model`` (usually built on the meta device) from the checkpoint at ``path``,
    sharded by ``plan`` over the tp axis of ``mesh``; every rank of the mesh calls it. A
    mesh without a tp axis (``backend.mesh(dp_shard=4)``) holds the model whole, ready for
    ``fully_shard``.

    ``plan`` is a dict of module or parameter paths to styles (transformers' and diffusers'
    plans as they ship), or ``"auto"`` for the model's own plan; keys that match nothing
    in this model are skipped, warned about once and listed in the result, as long as one
    key matches (a plan none of whose keys match is a ``PlanError`` naming the closest
    module paths). On a mesh with
    an ``ep`` axis (``backend.mesh(ep=2)``, ``backend.mesh(ep=2, tp=2)``) the experts are
    split over it by ``ep_plan`` (default: the model's own ``base_model_ep_plan``), and a
    rank reads only its own experts' bytes.
    ``path`` is a ``.safetensors`` file, a ``*.safetensors.index.json`` (any prefix), a
    folder holding one of them, or a torch DCP folder (with ``.metadata``). ``dtype`` casts
    floating-point tensors after slicing (``None`` keeps the file's dtypes). ``strict``
    raises on missing keys; a shape that disagrees with the model always raises.
    ``num_threads`` read in parallel (default ``min(8, cpus / ranks on this host)``);
    ``progress`` shows a tqdm bar on rank 0 (default: when stderr is a terminal).
    ``holding`` is ``"dtensor"`` or ``"local"`` (default: the backend's).
    Unknown keyword options raise ``TypeError``; ``device_map`` and other placement
    options of ``from_pretrained`` raise ``UnsupportedModelError`` (they cannot stream).

    FP8 checkpoints with block scales (``x.weight`` float8_e4m3fn, ``x.weight_scale_inv``
    float32, ``weight_block_size`` in the checkpoint's ``config.json``: DeepSeek-V3,
    Qwen3-FP8): a model holding transformers' ``FP8Linear`` modules keeps them quantized, each
    rank holding its weight shard and the scales of every block it touches (``dtype`` leaves
    both as they are); ``dequantize=True`` fills a model built unquantized (plain
    ``nn.Linear``), each rank dequantizing only its own shard (float32, cast once into
    ``dtype`` or the declared dtype) and the model's ``config.quantization_config`` is then
    removed, as transformers does. An FP8 checkpoint into a plain model without
    ``dequantize=True`` raises ``CheckpointError``.

    >>> with torch.device("meta"):                                          # doctest: +SKIP
    ...     model = MyModel(config)
    >>> sw.load(model, "ckpt/", plan=plan, mesh=backend.mesh(tp=4), dtype=torch.bfloat16)  # doctest: +SKIP
    LoadResult(tensors=291, bytes_read=4021813248, seconds=1.912, missing=0, unexpected=0)
    """
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

    source = open_source(path, dequantize=dequantize)
    check_quantized_source(source, specs, mesh)
    missing, unexpected = source.match(model, specs, strict=strict)
    check_nothing_left_on_meta(model, specs, missing)
    place = placement(model, specs, dims, dtype)
    names = [n for n in specs if n not in missing]
    reads = source.plan(place.wants(names))
    # dp replicas share their reads only where each process holds its own shards
    how = ReadOptions(dtype, place.device, reader_threads(num_threads),
                      mesh=None if dims.holding.one_process else mesh, window=place.window,
                      backend=dims.comm_backend)
    with Progress(reads.nbytes, progress, is_rank0(), "shardwise load") as bar:
        tensors = source.read(reads, finalize=place.finalize, options=how, on_bytes=bar)
    place.install(model, tensors, missing)
    move_non_persistent(model, dims.device)
    if dequantize:
        drop_quantization_config(model)
    return LoadResult(tuple(missing), tuple(unexpected), source.bytes_read,
                      time.perf_counter() - start, len(names), specs.unused_keys)


__all__ = [
    "LoadResult", "check_dtype", "check_nothing_left_on_meta", "load", "match_keys",
    "move_non_persistent",
]
