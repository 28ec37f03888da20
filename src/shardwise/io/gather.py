"""The per-tensor half of the gather save. :func:`collect_items` lists the tensors with their
canonical dtypes and shapes (from the specs: rank 0 knows every header first);
:class:`FileGatherer` gathers one tensor at a time to rank 0, which streams it into the file.
Every tp rank of rank 0's group calls :func:`gather_to_rank0` for every sharded tensor in the
same order, and every rank calls ``comm.agree`` at the same points, so a failure raises
everywhere."""

from __future__ import annotations

import contextvars
import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from shardwise.backends import Backend
from shardwise.comm import agree, capture
from shardwise.core.header import dtype_to_str, spec_nbytes
from shardwise.core.pieces import StoredPart
from shardwise.core.plan import resolve_plan
from shardwise.core.quant_layout import QuantTie
from shardwise.core.spec import Region, ShardSpec, chunk_layout, global_shape, local_layout
from shardwise.errors import CheckpointError, UnsupportedModelError
from shardwise.holding import is_dtensor
from shardwise.io.info import collect_checksums
from shardwise.io.read.mapped import copy_same
from shardwise.io.sink import OpenFile, WritePlan
from shardwise.io.storage import Location
from shardwise.parallel import ShardState, get_shard_state, local_of
from shardwise.quant import gather_scales_to_rank0

# Bytes gathered per collective, all ranks together (see num_chunks).
_CHUNK_BYTES = 64 << 20
_SMALL_BYTES = 1 << 20


def num_chunks(nbytes: int, rows: int) -> int:
    """How many row chunks of the local shards (``rows`` rows) to gather in turn for a tensor of
    ``nbytes``: about an eighth each keeps rank 0's peak near 1.25x the tensor."""
    per_gather = max(1, min(_CHUNK_BYTES, max(_SMALL_BYTES, nbytes // 8)))
    return max(1, min(rows, -(-nbytes // per_gather)))


def gather_to_rank0(backend: Backend, local: torch.Tensor, spec: ShardSpec, degree: int, group,
                    shape: tuple[int, ...], *, keep: bool = True, buffer: torch.Tensor | None = None,
                    receive: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """The canonical tensor of ``shape`` on global rank 0 (None elsewhere, or when not ``keep``).
    Every tp rank calls it with its (equal-sized) local shard; row chunks travel as raw bytes (any
    dtype) and land in their regions (``chunk_layout``). On rank 0 ``buffer`` (uint8, at least
    the tensor's bytes) and ``receive`` (one uint8 per tp rank, a chunk's bytes) are reused."""
    data = local.detach().contiguous()
    rows = data.shape[0]
    k = num_chunks(math.prod(shape) * data.element_size(), rows)
    step = -(-rows // k)
    full: torch.Tensor | None = None
    flat: torch.Tensor | None = None
    layouts: list[list[tuple[Region, tuple[int, ...]]]] = []
    if receive is None and backend.rank == 0:  # rank 0 receives even when it keeps nothing
        receive = [torch.empty(data[:step].numel() * data.element_size(), dtype=torch.uint8,
                               device=data.device) for _ in range(degree)]
    if keep and backend.rank == 0:
        full = (torch.empty(shape, dtype=data.dtype, device=data.device) if buffer is None
                else buffer[: math.prod(shape) * data.element_size()].view(data.dtype).view(shape))
        flat = full.view(-1).view(torch.uint8)
        layouts = [local_layout(shape, spec, degree, r) for r in range(degree)]
    for index, lo in enumerate(range(0, rows, step)):
        piece = data[lo : lo + step]
        nbytes = piece.numel() * piece.element_size()
        got, chunks = [r[:nbytes] for r in receive] if receive is not None else None, None
        if full is not None:
            assert flat is not None and got is not None  # set with full, on rank 0 (which always receives)
            # A chunk that is one contiguous stretch of the canonical tensor (a dim-0 shard,
            # two thirds of a Llama's bytes) is received in place: no copy afterwards.
            chunks = [chunk_layout(layout, data.shape, 0, k, index) for layout in layouts]
            for r, chunk in enumerate(chunks):
                start = _contiguous_start(chunk, shape, data.element_size(), nbytes)
                if start is not None:
                    got[r], chunks[r] = flat[start : start + nbytes], []
        backend.gather_into(piece.reshape(-1).view(torch.uint8), got, dst=0, group=group)
        if chunks is None or full is None or got is None:  # not rank 0, or nothing kept
            continue
        for chunk, raw in zip(chunks, got, strict=True):
            if chunk:  # empty: received in place
                part = raw.view(data.dtype).view(piece.shape)
                for region, off in chunk:  # copy_same: F4 has no copy kernel on torch 2.9
                    copy_same(full[region.slices()], part[Region(off, region.sizes).slices()])
    return full


def _contiguous_start(chunk, shape: tuple[int, ...], itemsize: int, nbytes: int) -> int | None:
    """The byte offset in the canonical tensor of ``shape`` where a chunk of ``nbytes`` lands
    whole, when it is one run of whole rows taken from the chunk's start; else None."""
    if len(chunk) != 1:
        return None
    region, off = chunk[0]
    if any(off) or region.sizes[1:] != tuple(shape[1:]) or any(region.offsets[1:]):
        return None
    if region.numel * itemsize != nbytes:
        return None
    return region.offsets[0] * math.prod(shape[1:]) * itemsize


@dataclass
class SaveItem:
    """One tensor to write, with this rank's local shard of it."""

    name: str
    dtype: str
    shape: tuple[int, ...]          # canonical
    spec: ShardSpec
    gathered: bool                  # sharded over degree > 1: needs a gather
    local: torch.Tensor = field(repr=False)
    degree: int = 1                 # of the mesh axis the spec shards over
    tie: QuantTie | None = None     # an FP8 weight's scales: held and gathered by their tie
    rank: int = 0                   # this rank on that axis

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.local.element_size()


def collect_items(model: nn.Module) -> tuple[list[SaveItem], ShardState | None]:
    """One item per tensor to write (tied weights once), with its canonical dtype and shape."""
    state = get_shard_state(model)
    specs = state.specs if state is not None else resolve_plan(model, {}, 1)
    tensors = model.state_dict(keep_vars=True)
    items = []
    for name, spec in specs.items():
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} was parallelised but is no longer in the model's "
                                  "state_dict; save the model as it was parallelised or loaded")
        t = tensors[name]
        check_holding(name, t, state)
        local = local_of(t).detach()
        if local.is_meta:
            raise CheckpointError(f"tensor {name!r} is on the meta device, so it has no values to "
                                  "save; load or materialise the model first")
        degree, rank = state.gather_coords(spec) if state is not None else (1, 0)
        gathered = degree > 1 and not spec.replicated
        tie = specs.ties.get(name) if gathered else None
        shape = global_shape(local.shape, spec, degree) if gathered and tie is None else tuple(local.shape)
        shape = tie.scale_shape if tie is not None else shape
        items.append(SaveItem(name, dtype_to_str(local.dtype), shape, spec, gathered, local, degree, tie,
                              rank))
    return items, state


def check_holding(name: str, t: torch.Tensor, state: ShardState | None) -> None:
    if not is_dtensor(t):
        return
    if state is None:
        raise UnsupportedModelError(
            f"{name!r} is a DTensor, but shardwise did not parallelise this model (sw.parallelize or "
            "sw.load), so its shard layout is unknown; use sw.save(model, path, distributed=True)")
    meshes = [m for m in (state.tp_mesh, state.ep_mesh) if m is not None]
    mesh = t.device_mesh
    if not any(mesh is m or mesh == m for m in meshes):
        names = mesh.mesh_dim_names
        raise UnsupportedModelError(
            f"{name!r} is sharded over mesh axes {names} besides the tp axis (FSDP over tensor "
            "parallelism?); the gather save does not support that layout yet: save with "
            "sw.save(model, path, distributed=True), then sw.consolidate for safetensors")


class FileGatherer:
    """The rank-0 stream (``sw.save``'s default) of ``plan``, each file opened by ``open_file``
    (a gathered format's): every tensor is gathered to rank 0, which writes the files in turn.
    Every rank calls :meth:`write` (or :meth:`write_file` for every file, in the same order)."""

    def __init__(self, backend, state: ShardState | None, items: Mapping[str, SaveItem],
                 plan: WritePlan, *, open_file: OpenFile):
        self.backend, self.items, self.plan, self.open_file = backend, items, plan, open_file
        self.meta = dict(plan.header)
        self.parts: dict[str, StoredPart] = dict(plan.parts)  # stored name -> its boxes (hub layout)
        self.rank = backend.rank if backend is not None else 0
        # Per mesh axis (tp, ep): its group, and whether this rank's group is the one holding
        # global rank 0, which alone gathers; other replicas only join agree().
        axes = (("tp", state.tp_mesh, state.group), ("ep", state.ep_mesh, state.ep_group)) if state else ()
        self.axes = {axis: (group, 0 in mesh.mesh.flatten().tolist()) for axis, mesh, group in axes
                     if mesh is not None}
        self._buffer: torch.Tensor | None = None
        self._receive: list[torch.Tensor] | None = None
        self._held: dict[str, torch.Tensor | None] = {}
        self._left: Counter[str] = Counter()  # model tensor -> boxes of it still to write
        self._closing: Callable[[], Exception | None] | None = None

    def _assembly_buffer(self, item: SaveItem) -> torch.Tensor | None:
        """One buffer, as large as the largest gathered tensor, that every tensor is built in
        on rank 0: its pages are touched once, not once per tensor (3 GB/s of page faults)."""
        if self._buffer is None:
            size = max(i.nbytes for i in self.items.values() if i.gathered)
            self._buffer = torch.empty(size, dtype=torch.uint8, device=item.local.device)
        return self._buffer

    def _receive_buffers(self, item: SaveItem) -> list[torch.Tensor]:
        """One chunk-sized buffer per tp rank, as large as the largest chunk of any tensor."""
        if self._receive is None:
            gathered = [i for i in self.items.values() if i.gathered]
            size = max(_chunk_bytes(i) for i in gathered)
            self._receive = [torch.empty(size, dtype=torch.uint8, device=item.local.device)
                             for _ in range(max(i.degree for i in gathered))]
        return self._receive[:item.degree]

    def write(self, folder: Location | None, bar, *, what: str) -> dict[str, str]:
        """Collective over the world: every rank joins the gathers of every file in order;
        rank 0 (``folder`` its temporary folder, None elsewhere) writes them. Returns
        ``{stored tensor: checksum}`` on rank 0, computed as it writes (empty elsewhere)."""
        with collect_checksums() as checksums:
            try:
                for f in self.plan.files:
                    bar.file(f.name)
                    error = self.write_file(folder / f.name if folder is not None else None, f.tensors, bar)
                    agree(self.backend, error, what=what)
                agree(self.backend, self.finish(), what=what)  # the last file's close
            finally:
                self.finish()  # no close left running past a failure
        return dict(checksums)

    def write_file(self, path: Location | None, group, bar) -> Exception | None:
        """Gather and write one file's tensors; return rank 0's first failure (still joining every
        gather), None elsewhere. In a hub layout a model tensor is gathered once, kept until its
        last box is written. The file is closed (committed: over an object store, the end of its
        upload) in the background while the next file is gathered; :meth:`finish` waits for it
        and returns its failure. Call :meth:`finish` after each file, before the next close."""
        error, writer = None, None
        if self.rank == 0:
            try:
                assert path is not None  # rank 0 is given its file's path (write)
                writer = self.open_file(path, group, self.meta)
            except Exception as e:
                error = e
        try:
            for name, dtype, shape in group:
                part = self.parts.get(name)
                # the item looked up once, held by no name: a lazy mapping reads it (consolidate)
                data = (self._full(self.items[name], writer) if part is None
                        else part.assemble(partial(self._model_tensor, writer=writer)))
                if writer is not None:
                    try:
                        assert data is not None  # rank 0 keeps what it writes (keep=writer is not None)
                        writer.write(name, data if data.device.type == "cpu" else data.cpu())
                    except Exception as e:
                        error = e
                        writer.abort()
                        writer = None
                del data
                bar(spec_nbytes(dtype, shape))
            closing = self.finish()  # the previous file's close: at most one runs beside a file
            error = error or closing
            if writer is not None:
                self._closing = _in_background(writer.close)
                writer = None
        finally:
            if writer is not None:
                writer.abort()
        return error

    def finish(self) -> Exception | None:
        """Wait for the close :meth:`write_file` left running; its failure, if any."""
        closing, self._closing = self._closing, None
        return closing() if closing is not None else None

    def _full(self, item: SaveItem, writer) -> torch.Tensor | None:
        """The canonical tensor on rank 0 (None elsewhere); every rank of its group joins."""
        pg, gathers = self.axes.get(item.spec.axis, (None, False))
        if item.gathered and gathers and item.tie is not None:  # each scale once (shardwise.quant)
            return gather_scales_to_rank0(self.backend, item.local, item.tie, item.spec, item.degree,
                                          item.rank, pg, keep=writer is not None)
        if item.gathered and gathers:  # after a failure too: peers must not wait
            return gather_to_rank0(self.backend, item.local, item.spec, item.degree, pg,
                                   item.shape, keep=writer is not None,
                                   buffer=self._assembly_buffer(item) if writer else None,
                                   receive=self._receive_buffers(item) if self.rank == 0 else None)
        return item.local if writer is not None else None

    def _model_tensor(self, name: str, writer) -> torch.Tensor | None:
        """Model tensor ``name`` on rank 0 (None elsewhere), for a box of a hub-layout tensor:
        gathered once, when its first box is written, and kept until its last."""
        if not self._left:
            self._left = Counter(n for p in self.parts.values() for n, _ in p.fragments)
        left = self._left[name]
        if name not in self._held:
            item = self.items[name]
            full = self._full(item, writer)
            # the assembly buffer is reused by the next gather: keep a copy while boxes remain
            self._held[name] = full.clone() if full is not None and left > 1 and item.gathered else full
        full = self._held[name]
        self._left[name] = left - 1
        if left == 1:
            del self._held[name]
        return full


def _in_background(fn) -> Callable[[], Exception | None]:
    """Start ``fn()`` on a thread, in this thread's context (a writer's close reports its
    checksums to the enclosing ``collect_checksums``); returns the join, which gives its failure."""
    context, error = contextvars.copy_context(), [None]

    def run():
        error[0] = capture(lambda: context.run(fn))

    thread = threading.Thread(target=run, name="shardwise-close", daemon=True)
    thread.start()

    def join() -> Exception | None:
        thread.join()
        return error[0]

    return join


def _chunk_bytes(item: SaveItem) -> int:
    """Bytes of the largest row chunk of one rank's shard of ``item`` (see gather_to_rank0)."""
    local = item.local
    rows = max(1, local.shape[0]) if local.dim() else 1
    k = num_chunks(item.nbytes, rows)
    return -(-rows // k) * (local.numel() // rows if rows else 0) * local.element_size()


__all__ = ["FileGatherer", "SaveItem", "collect_items", "gather_to_rank0", "num_chunks"]
