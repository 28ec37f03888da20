"""Distributed checkpoints through torch DCP: every rank writes its own regions as canonical
chunks, so a checkpoint loads at any degree and in plain ``torch.distributed.checkpoint``;
``shardwise.json`` records the layout and every chunk's checksum. A save is one ``Saving``
(complete or absent). :class:`DcpSource` reads one back, for loads and the offline tools. The
``.metadata`` is a pickle (allow-listed classes): trust its source."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: name it
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

import shardwise.comm as comm
from shardwise._version import __version__
from shardwise.backends import Backend, coordination_group
from shardwise.core.adapter import adapter_for
from shardwise.core.header import dtype_to_str
from shardwise.core.plan import ResolvedPlan, plan_summary
from shardwise.core.spec import Region, intersect
from shardwise.errors import CheckpointError, CollectiveError, ShardwiseError
from shardwise.holding import is_dtensor
from shardwise.io.formats.dcp.items import (
    CanonicalLoadPlanner,
    CanonicalSavePlanner,
    HashingWriter,
    Placed,
    check_fp8_match,
    place,
    read_dtype,
    scale_placed,
    side_by_side,
)
from shardwise.io.formats.dcp.metadata import (
    MetadataReader,
    check_tensors,
    chunk_checksum,
    read_chunk_into,
    read_metadata,
)
from shardwise.io.formats.safetensors.reader import want_layout
from shardwise.io.info import ALGORITHM, chunk_key, read_info
from shardwise.io.sink import Saving
from shardwise.io.source import Blob, Description, Finalize, ReadOptions, Reads, Want
from shardwise.io.storage import HandleFile, Handles, Location
from shardwise.io.storage.transaction import target_path
from shardwise.mesh import get_shard_state

if TYPE_CHECKING:
    from shardwise.mesh import AxisMesh


INFO_FORMAT = "shardwise-dcp"


def model_placed(model: nn.Module) -> dict[str, Placed]:
    """``{tensor name: Placed}`` for every parameter and persistent buffer of ``model``, in
    state-dict order; a tied tensor appears once, under its first name."""
    state = get_shard_state(model)
    tensors = model.state_dict(keep_vars=True)
    if state is not None:  # a quantized weight's scales: each block once (dcp.items.scale_placed)
        ties = state.specs.ties
        return {n: scale_placed(tensors[n], ties[n], spec, *state.coords(spec), name=n) if n in ties
                else place(tensors[n], spec, *state.coords(spec), name=n) for n, spec in state.specs.items()}
    seen: set[int] = set()
    out = {}
    for n, t in tensors.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[n] = place(t, None, 1, 0, name=n)
    return out


def checkpoint_info(model: nn.Module, placed: Mapping[str, Placed], *, kind: str,
                    metadata: Mapping | None = None) -> dict:
    """The informational ``shardwise.json`` content for a save of ``model``."""
    state = get_shard_state(model)
    dtensors = [t for t in model.state_dict(keep_vars=True).values() if is_dtensor(t)]
    mesh: AxisMesh | None = state.mesh if state is not None else next(
        (t.device_mesh for t in dtensors), None)
    sharded_axes = sorted({(t.device_mesh.mesh_dim_names or ("?",) * t.device_mesh.ndim)[i]
                           for t in dtensors for i, p in enumerate(t.placements) if p.is_shard()})
    return {
        "format": INFO_FORMAT, "version": 1, "kind": kind,
        "shardwise": __version__, "torch": torch.__version__,
        "world_size": comm.world_size(),
        "mesh": None if mesh is None else {"axes": list(mesh.mesh_dim_names or ()),
                                           "shape": list(mesh.mesh.shape)},
        "degree": state.degree if state is not None else 1,
        "holding": state.holding.name if state is not None else None,
        "sharded_axes": sharded_axes,
        "plan": plan_summary(state.specs) if state is not None else {},
        "tensors": {n: {"dtype": dtype_to_str(p.local.dtype), "shape": list(p.shape)}
                    for n, p in placed.items()},
        "metadata": dict(metadata or {}),
        # what sw.save's index metadata would carry (total_parameters), for sw.consolidate
        "index_metadata": (adapter_for(model).index_metadata(model, {n: tuple(p.shape)
                                                                     for n, p in placed.items()})
                           if kind == "model" else {}),
    }


def gather_checksums(checksums: dict[str, dict[str, str]], what: str, backend: Backend | None) -> dict:
    """Every rank's chunk checksums (``{name: {chunk key: checksum}}``, each chunk written by one
    rank) merged on rank 0 as ``shardwise.json``'s "checksums"; every rank calls it, after the
    data is written. Other ranks get an empty record."""
    everyone = comm.gather_object(checksums, dst=0, group=coordination_group(backend), purpose=what)
    if everyone is None:  # not rank 0
        return {}
    sums: dict = {}
    for part in everyone:
        for fqn, chunks in part.items():
            sums.setdefault(fqn, {}).update(chunks)
    return {"algorithm": ALGORITHM, "chunks": sums}


def dcp_error(path, e: BaseException, what: str) -> ShardwiseError:
    """A ShardwiseError for a failure that ``dcp.save`` / ``dcp.load`` raised: every rank's
    message from a ``CheckpointException`` (a CheckpointError when each rank's failure was
    bad input, such as a corrupt file); a CollectiveError for a collective that failed."""
    if isinstance(e, ShardwiseError):
        return e
    if isinstance(e, CheckpointException):
        excs = {rank: w[0] if isinstance(w, tuple) else w for rank, w in e.failures.items()}
        failures = {rank: f"{type(exc).__name__}: {exc}" for rank, exc in excs.items()}
        if all(isinstance(exc, ValueError) for exc in excs.values()):
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
            return CheckpointError(f"{path}: {what} failed: {detail}")
        return CollectiveError(f"{path}: {what} failed on rank(s) {sorted(failures)}", failures)
    return CollectiveError(f"{path}: {what} failed: a collective failed, so another rank stopped "
                           f"or died ({type(e).__name__}: {e})")


_ASYNC_GROUP: dict = {}


def _async_group():
    # The background thread of an async save runs DCP's collectives while training goes
    # on with its own on the default group; sharing one group would interleave them.
    if not dist.is_initialized():
        return None
    key = id(dist.group.WORLD)
    if key not in _ASYNC_GROUP:
        _ASYNC_GROUP[key] = dist.new_group(backend="gloo")
    return _ASYNC_GROUP[key]


class AsyncSave:
    """The handle of an async save. Every rank must call :meth:`wait`, which finishes the
    write and moves the checkpoint into place (it meets the other ranks once)."""

    def __init__(self, future, finish: Callable[[], None], fail: Callable[[BaseException], None]):
        self._future = getattr(future, "upload_completion", future)
        self._finish, self._fail = finish, fail
        self._done = False
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True when the data is written (``wait`` still has to move it into place)."""
        return self._done or self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is complete and in place; raises if the save failed
        (again on every later call), or ``TimeoutError`` if the data is not written within
        ``timeout`` seconds (the save goes on: call ``wait`` again)."""
        if self._error is not None:
            raise self._error
        if self._done:
            return
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise
        except (Exception, CheckpointException) as e:
            self._done = True
            try:
                self._fail(e)
            except CheckpointError as error:
                self._error = error
                raise
        self._done = True
        self._finish()


def write_checkpoint(path: Location, state_dict: dict, placed: Mapping[str, Placed], info: dict, *,
                     backend: Backend | None, overwrite: bool = False, async_save: bool = False,
                     planner: CanonicalSavePlanner | None = None,
                     side_files: Callable[[Location], object] | None = None) -> AsyncSave | None:
    """Save ``state_dict`` (local tensors for the ``placed`` keys, plain values otherwise) as a
    canonical DCP checkpoint at ``path``, in one ``Saving``; every rank calls it. With
    ``async_save`` the handle's ``wait`` completes it. ``planner`` replaces
    ``CanonicalSavePlanner(placed)``; ``side_files(folder)`` writes beside the data on rank 0."""
    saving = Saving(path, overwrite=overwrite, backend=backend,
                    what=f"a distributed save to {target_path(path)}", every_rank_writes=True)
    planner = planner or CanonicalSavePlanner(placed)
    writer = HashingWriter(saving.folder)
    no_dist = not dist.is_initialized()

    def finish():
        with saving:
            checksums = gather_checksums(writer.checksums, f"moving {saving.what} into place", backend)
            saving.commit(info={**info, "checksums": checksums} if saving.rank0 else None,
                          side_files=side_files)

    def fail(e: BaseException) -> NoReturn:
        saving.discard()
        raise CheckpointError(f"{saving.target}: the distributed save failed; the target is "
                              f"unchanged: {e}") from e

    try:
        if async_save:
            future = dcp.async_save(state_dict, storage_writer=writer, planner=planner,
                                    process_group=_async_group(), no_dist=no_dist)
            return AsyncSave(future, finish, fail)
        dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=no_dist,
                 process_group=coordination_group(backend))
    except (Exception, CheckpointException) as e:  # DCP raised on every rank (it gathers the failures)
        fail(e)
    finish()
    return None


def save_dcp(model: nn.Module, path: Location, *, backend: Backend | None, overwrite: bool = False,
             async_save: bool = False, metadata: Mapping | None = None,
             progress: bool | None = None) -> AsyncSave | None:
    """Write ``model`` as a canonical DCP checkpoint at ``path``; every rank calls it and writes
    only its own regions. ``metadata`` goes into ``shardwise.json`` (and, through
    ``sw.consolidate``, into the safetensors headers). With ``async_save=True`` it returns once
    the shards are copied aside: call ``.wait()`` on the handle, on every rank. ``progress`` is
    accepted for ``sw.save``'s signature; DCP reports none.

    >>> sw.save(model, "out/dcp", distributed=True)                    # doctest: +SKIP
    >>> handle = sw.save(model, "out/dcp", distributed=True, async_save=True)  # doctest: +SKIP
    >>> handle.wait()                                                   # doctest: +SKIP
    """
    state = get_shard_state(model)
    placed, planner = ((model_placed(model), None) if state is None
                       else state.holding.dcp_placed(model, state))
    info = checkpoint_info(model, placed, kind="model", metadata=metadata)
    state_dict = {n: p.local for n, p in placed.items()}
    # A Hugging Face model's config beside the data: consolidate rebuilds the hub layout and
    # from_pretrained reads its output.
    files = adapter_for(model).write_side_files
    return write_checkpoint(path, state_dict, placed, info, backend=backend, overwrite=overwrite,
                            async_save=async_save, planner=planner,
                            side_files=lambda folder: files(model, folder))


def read_checkpoint(path: Location, metadata, state_dict: dict, placed: Mapping[str, Placed], *,
                    backend: Backend | None) -> int:
    """Fill ``state_dict`` (the ``placed`` local tensors in place; other values replaced)
    from the checkpoint; every rank calls it. Returns the bytes this rank read."""
    reader = MetadataReader(path, metadata)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=CanonicalLoadPlanner(placed),
                 no_dist=not dist.is_initialized(), process_group=coordination_group(backend))
    except (Exception, CheckpointException) as e:  # a corrupt chunk, or a rank that died
        raise dcp_error(path, e, "reading the distributed checkpoint") from e
    return reader.bytes_read


class DcpSource:
    """The ``Source`` of a torch DCP checkpoint, read through torch's planner and storage reader
    (:func:`read_checkpoint`); ``read`` is collective, with the same ``options.window`` on every
    rank. ``metadata``: the checked metadata of the folder ``root`` (an incomplete checkpoint
    raises on opening); the offline tools read boxes and chunks through the storage."""

    name = "dcp"

    def __init__(self, path: Location):
        self.root = path
        self.metadata = read_metadata(path)
        self._tensors = {k: m for k, m in self.metadata.state_dict_metadata.items()
                         if isinstance(m, TensorStorageMetadata)}  # checkpoint key -> its chunks
        self._handles = Handles()
        self.bytes_read = 0
        self._key: dict[str, str] = {}  # model name -> checkpoint key
        self._shape: dict[str, tuple[int, ...]] = {}  # checkpoint key -> the model's shape

    def _file(self, rel: str) -> HandleFile:
        return HandleFile(self._handles.get(self.root / rel))

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {k: (m.properties.dtype, tuple(m.size)) for k, m in self._tensors.items()}

    def use_module_names(self, wanted: set[str]) -> None:
        pass  # a distributed checkpoint stores the module's names

    def read_box(self, name: str, box: Region) -> torch.Tensor:
        md = self._tensors[name]
        dtype = md.properties.dtype
        infos = [(c, self.metadata.storage_data[MetadataIndex(name, c.offsets)]) for c in md.chunks]
        if any(getattr(info, "transform_descriptors", None) for _, info in infos):
            # a transformed (compressed) chunk: the whole tensor through DCP's own reader
            whole = torch.empty(md.size, dtype=dtype)
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({name: whole}, storage_reader=MetadataReader(self.root, self.metadata), no_dist=True)
            return whole[box.slices()].clone()
        out = torch.empty(box.sizes, dtype=dtype)
        for chunk, info in infos:
            stored = Region(tuple(chunk.offsets), tuple(chunk.sizes))
            both = intersect(box, stored)
            if both is None or both.numel == 0:
                continue  # read_metadata checked that the chunks tile the tensor
            dest = out[Region(tuple(b - o for b, o in zip(both.offsets, box.offsets, strict=True)),
                              both.sizes).slices()]
            in_chunk = tuple(b - c for b, c in zip(both.offsets, stored.offsets, strict=True))
            read_chunk_into(self._file(str(info.relative_path)), info, in_chunk, both.sizes, dest,
                            dtype=dtype, sizes=stored.sizes)
        return out

    def describe(self) -> Description:
        values = tuple(n for n in self.metadata.state_dict_metadata if n not in self._tensors)
        files = tuple(sorted({str(info.relative_path) for info in self.metadata.storage_data.values()}))
        return Description("torch distributed checkpoint (DCP)", files, layout=read_info(self.root),
                           values=values, chunks={n: len(m.chunks) for n, m in self._tensors.items()})

    def blobs(self) -> Iterator[Blob]:
        for name, md in self._tensors.items():
            dtype = md.properties.dtype
            for chunk in md.chunks:
                info = self.metadata.storage_data[MetadataIndex(name, chunk.offsets)]

                def digest(algorithm: str, info=info, sizes=tuple(chunk.sizes), dtype=dtype):
                    got, _, zipped = chunk_checksum(self._file(str(info.relative_path)), info, dtype=dtype,
                                                    sizes=sizes, algorithm=algorithm)
                    return got, zipped

                nbytes = math.prod(chunk.sizes) * dtype.itemsize
                yield Blob(name, chunk_key(chunk.offsets), nbytes, digest, own=True)

    def close(self) -> None:
        self._handles.close()

    def match(self, model: nn.Module, specs: ResolvedPlan, *, strict: bool) -> tuple[list[str], list[str]]:
        own = model.state_dict(keep_vars=True)
        stored = self.metadata.state_dict_metadata
        # a tensor may be stored under a tied alias of its name
        self._key = {n: n if n in stored else next(
            (a for a, kept in specs.aliases.items() if kept == n and a in stored), n) for n in specs}
        check_fp8_match(self.root, stored, self._key, {n: own[n].dtype for n in specs})
        wanted = {self._key[n]: tuple(own[n].shape) for n in specs}
        missing, unexpected = check_tensors(self.root, self.metadata, wanted, strict=strict,
                                            allowed_extra=specs.aliases)
        self._shape = wanted
        return [n for n in specs if self._key[n] in missing], unexpected

    def plan(self, wants: Mapping[str, Want]) -> Reads:
        """One :class:`Placed` per checkpoint key: its wanted local tensors side by side."""
        groups: dict[str, list[tuple[str, Want]]] = {}
        for key, w in wants.items():
            groups.setdefault(self._key[w.name], []).append((key, w))
        # the matched keys are tensors (check_tensors)
        total = sum(math.prod(want_layout(self._shape[k], w)[0]) * self._tensors[k].properties.dtype.itemsize
                    for k, group in groups.items() for _, w in group)
        return Reads(wants, total, groups)

    def read(self, reads: Reads, *, finalize: Finalize, options: ReadOptions,
             on_bytes: Callable[[int], None] | None = None) -> dict:
        md = self._tensors  # the matched keys are tensors (check_tensors)
        out, batch, size = {}, {}, 0
        keys = list(reads.detail)
        for i, k in enumerate(keys):
            want = read_dtype(md[k].properties.dtype, reads.detail[k][0][1], options.dtype)
            batch[k] = side_by_side(self._shape[k], reads.detail[k], want, options.device)
            size += batch[k][0].local.numel() * batch[k][0].local.element_size()
            # One dcp.load (a collective plan exchange) per window of bytes, or for the whole
            # checkpoint when the placement streams (window None): never one per tensor.
            if i + 1 < len(keys) and (options.window is None or size < options.window):
                continue
            nbytes = read_checkpoint(self.root, self.metadata, {k: p.local for k, (p, _) in batch.items()},
                                     {k: p for k, (p, _) in batch.items()}, backend=options.backend)
            self.bytes_read += nbytes
            if on_bytes is not None:
                on_bytes(nbytes)
            for placed, parts in batch.values():
                for key, view in parts(placed.local):
                    out[key] = finalize(key, view)
            batch, size = {}, 0
        return out


__all__ = ["AsyncSave", "DcpSource", "INFO_FORMAT", "checkpoint_info", "dcp_error",
           "gather_checksums", "model_placed", "read_checkpoint", "save_dcp", "write_checkpoint"]
