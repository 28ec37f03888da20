"""What the tests, the benchmarks and the validation suite share, public so that none of them
reaches into a private module. Imported on use, never by ``import shardwise``.

>>> from shardwise import testing
>>> testing.spawn(lambda: 1, 2)                                    # doctest: +SKIP
[1, 1]
>>> testing.parse_size("1GiB")
1073741824"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

import shardwise as sw
from shardwise.core.header import dtype_to_str
from shardwise.core.plan import ResolvedPlan, resolve_plan
from shardwise.core.quant import quantize_fp8_blocks
from shardwise.core.quant_layout import dequantize_local, scale_layout, take_layout
from shardwise.core.spec import Region, ShardSpec, split
from shardwise.errors import UsageError
from shardwise.holding import local_of
from shardwise.io import info
from shardwise.io.formats import open_source
from shardwise.io.formats.safetensors.files import StreamingWriter, index_json, parse_size, plan_files
from shardwise.io.storage import locate, write_small
from shardwise.launch import PeakMemory, RankFailure, free_port, memory_status, reset_high_water_mark, spawn
from shardwise.parallel import ShardState, get_shard_state


def plan_specs(model: nn.Module, plan, degree: int, *, strict: bool = False) -> ResolvedPlan:
    """``{tensor name: ShardSpec}`` that ``plan`` gives ``model`` at ``degree``, as every load,
    parallelize and save resolves it; works on a meta model, without a process group.
    ``strict=True`` makes a key that matches nothing a ``PlanError``."""
    return resolve_plan(model, plan, degree, strict=strict)


def shard_state(model: nn.Module) -> ShardState:
    """What ``sw.load`` / ``sw.parallelize`` left on ``model``: its specs, degrees and ranks."""
    state = get_shard_state(model)
    if state is None:
        raise UsageError(f"{type(model).__name__} was not loaded or parallelized by shardwise")
    return state


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's local tensor of ``tensor`` (a DTensor's ``to_local()``; a plain tensor as is)."""
    return local_of(tensor)


def expected_shard(tensor: torch.Tensor, spec: ShardSpec, degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the canonical ``tensor`` under ``spec`` at ``degree``: what a
    load must leave on that rank (the same region math as every path)."""
    return split(tensor, spec, degree, rank)


def expected_scale_shard(scale: torch.Tensor, tie, spec: ShardSpec, degree: int, rank: int,
                         shape: tuple[int, ...]) -> torch.Tensor:
    """Rank ``rank``'s local block scales (of ``shape``) of the quantized pair ``tie``, from the
    whole ``scale`` tensor: what a load that keeps the weights quantized leaves there."""
    return take_layout(scale, scale_layout(tie, spec, degree, rank), shape)


def dequantized_shard(weight: torch.Tensor, scale: torch.Tensor, tie, spec: ShardSpec, degree: int,
                      rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A rank's FP8 weight shard and its local scales in ``dtype``, as ``dequantize=True`` gives."""
    return dequantize_local(weight, scale, tie, spec, degree, rank, dtype)


def read_all(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` (any format shardwise reads), whole, in one
    process, through the same reader ``sw.load`` and ``sw.consolidate`` use."""
    source = open_source(locate(path))
    try:
        return {name: source.read_box(name, Region((0,) * len(shape), tuple(shape)))
                for name, (_, shape) in source.tensors().items()}
    finally:
        source.close()


def preload() -> None:
    """Import every module the public verbs import on first use (the DCP reader's
    torch.distributed.checkpoint takes seconds): a timing that starts after this measures the
    call, not the imports."""
    for name in ("load", "save", "consolidate", "verify", "diff", "inspect", "from_pretrained"):
        getattr(sw, name)
    for module in ("torch.distributed.checkpoint", "shardwise.io.formats.dcp.checkpoint",
                   "shardwise.io.formats.sharded.source"):
        importlib.import_module(module)


def write_checkpoint(folder: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]],
                     shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                     max_shard_size: int | str, metadata: dict | None = None) -> list[Path]:
    """Write an ordinary sharded safetensors checkpoint (files and index) into ``folder``, one
    tensor at a time: ``shapes`` names every tensor (its shape and dtype, in file order) and
    ``tensors`` yields them in that order, so that the whole checkpoint never is in memory.
    ``metadata`` goes into the index. Returns the files written."""
    specs = [(name, dtype_to_str(dtype), tuple(shape)) for name, (shape, dtype) in shapes.items()]
    file_plan = plan_files(specs, max_shard_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    it = iter(tensors)
    files = []
    for fname, group in file_plan:
        with StreamingWriter(folder / fname, group) as writer:
            for name, _, _ in group:
                got, tensor = next(it)
                if got != name:
                    raise UsageError(f"write_checkpoint: tensor {got!r} given where {name!r} comes next")
                writer.write(name, tensor)
        files.append(folder / fname)
    total = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                for shape, dtype in shapes.values())
    index = folder / "model.safetensors.index.json"
    text = json.dumps(index_json(file_plan, total, metadata), indent=1)
    write_small(locate(index), text.encode())
    return files


@contextlib.contextmanager
def without_checksums() -> Iterator[None]:
    """Saves inside the block record a digest that hashes nothing: for measuring what the
    checksums cost, never for a checkpoint anyone reads (its ``verify`` fails)."""
    class _NoDigest:
        def update(self, buf) -> None:
            pass

        def hexdigest(self) -> str:
            return "0" * 16

    real = info.DIGESTS[info.ALGORITHM]
    info.DIGESTS[info.ALGORITHM] = (_NoDigest, 16)
    try:
        yield
    finally:
        info.DIGESTS[info.ALGORITHM] = real


__all__ = [
    "PeakMemory", "RankFailure", "dequantized_shard", "expected_scale_shard", "expected_shard",
    "free_port", "local_shard", "memory_status", "parse_size", "plan_specs", "preload",
    "quantize_fp8_blocks", "read_all", "reset_high_water_mark", "shard_state", "spawn",
    "without_checksums", "write_checkpoint",
]
