"""Distributed checkpoints through torch DCP: every rank writes its own regions as canonical
chunks, so a checkpoint loads at any degree and in plain ``torch.distributed.checkpoint``;
``shardwise.json`` records the layout and every chunk's checksum. A save is one ``Saving``
(complete or absent). :class:`DcpSource` reads one back, for loads and the offline tools. The
``.metadata`` is a pickle (allow-listed classes): trust its source."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: name it
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from shardwise.backends import Backend, coordination_group
from shardwise.core.plan import ResolvedPlan
from shardwise.core.spec import Region, intersect
from shardwise.errors import CheckpointError, CollectiveError, ShardwiseError
from shardwise.io.dist_save import checkpoint_info, commit, model_side_files
from shardwise.io.formats.dcp.items import (
    CanonicalLoadPlanner,
    CanonicalSavePlanner,
    HashingWriter,
    check_fp8_match,
    read_dtype,
    side_by_side,
)
from shardwise.io.formats.dcp.metadata import (
    MetadataReader,
    check_tensors,
    chunk_checksum,
    read_chunk_into,
    read_metadata,
)
from shardwise.io.formats.dcp.spmd import spmd_placed
from shardwise.io.info import chunk_key, read_info
from shardwise.io.placed import Placed, model_placed
from shardwise.io.read.reader import want_layout
from shardwise.io.sink import Saving
from shardwise.io.source import Blob, Description, Finalize, ReadOptions, Reads, Want
from shardwise.io.storage import HandleFile, Handles, Location
from shardwise.mesh import get_shard_state

if TYPE_CHECKING:
    pass




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
                     backend: Backend | None, overwrite: bool = False, replaceable: Sequence[str] = (),
                     async_save: bool = False,
                     planner: CanonicalSavePlanner | None = None,
                     side_files: Callable[[Location], object] | None = None) -> AsyncSave | None:
    """Save ``state_dict`` (local tensors for the ``placed`` keys, plain values otherwise) as a
    canonical DCP checkpoint at ``path``, in one ``Saving``; every rank calls it. With
    ``async_save`` the handle's ``wait`` completes it. ``planner`` replaces
    ``CanonicalSavePlanner(placed)``; ``side_files(folder)`` writes beside the data on rank 0;
    ``replaceable``: what ``overwrite`` may replace (``io.formats.checkpoint_files``)."""
    saving = Saving(path, overwrite=overwrite, backend=backend, what="a distributed save to {target}",
                    replaceable=replaceable, every_rank_writes=True)
    planner = planner or CanonicalSavePlanner(placed)
    writer = HashingWriter(saving.folder)
    no_dist = not dist.is_initialized()

    def finish():
        commit(saving, info, writer.checksums, backend=backend, side_files=side_files)

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
             replaceable: Sequence[str] = (), async_save: bool = False, metadata: Mapping | None = None,
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
    placed, planner = (spmd_placed(model, state) if state is not None and state.holding.one_process
                       else (model_placed(model), None))
    info = checkpoint_info(model, placed, kind="model", metadata=metadata)
    state_dict = {n: p.local for n, p in placed.items()}
    return write_checkpoint(path, state_dict, placed, info, backend=backend, overwrite=overwrite,
                            replaceable=replaceable, async_save=async_save, planner=planner,
                            side_files=model_side_files(model))


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


__all__ = ["AsyncSave", "DcpSource", "dcp_error", "read_checkpoint", "save_dcp", "write_checkpoint"]
