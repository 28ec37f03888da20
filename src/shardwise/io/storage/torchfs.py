"""torch DCP over a :class:`~shardwise.io.storage.Storage`: torch's ``FileSystemWriter`` and
``FileSystemReader`` with a ``FileSystemBase`` over :class:`~shardwise.io.storage.Location`
values. Each object is a storage writer, durable and visible on ``commit`` (so torch's
``sync_files`` is off and ``.metadata`` is written in place); the save transaction publishes
the folder. Imported only with torch.distributed.checkpoint (slow to import)."""

from __future__ import annotations

import io
import pickle
from contextlib import contextmanager

from torch.distributed.checkpoint import filesystem as _torch_fs
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from shardwise.io.storage import HandleFile, Location, WriteHandle


class _WriteStream(io.RawIOBase):
    """A sequential binary stream into a write handle (``tell``: the bytes written)."""

    def __init__(self, out: WriteHandle):
        super().__init__()
        self._out, self._pos = out, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self._out.write(view)
        self._pos += len(view)
        return len(view)

    def tell(self) -> int:
        return self._pos


class LocationFS(FileSystemBase):
    """DCP's file system over locations; every rank uses its own."""

    @contextmanager
    def create_stream(self, path, mode: str):
        loc = _location(path)
        if mode == "rb":
            handle = loc.open()
            try:
                # torch.load reads a stream whose records it cannot tell: unbuffered, each of its
                # many small reads would be a storage read (a system call, a request)
                yield io.BufferedReader(HandleFile(handle))
            finally:
                handle.close()
            return
        assert mode == "wb", mode
        out = loc.create()
        try:
            yield _WriteStream(out)
            out.commit()
        finally:
            out.abort()

    def concat_path(self, path, suffix: str) -> Location:  # type: ignore[override]
        return _location(path) / suffix

    def init_path(self, path) -> Location:  # type: ignore[override]
        return _location(path)

    def mkdir(self, path) -> None:
        pass  # folders are implicit: the transaction made the staging folder

    def exists(self, path) -> bool:
        return _location(path).exists()

    def rename(self, path, new_path) -> None:
        raise NotImplementedError("LocationWriter writes .metadata in place; nothing renames")

    def rm_file(self, path) -> None:
        raise NotImplementedError("a save writes into a fresh staging folder; nothing is removed")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, Location)


def _location(path) -> Location:
    assert isinstance(path, Location), f"DCP over a storage takes Locations, got {path!r}"
    return path


class LocationWriter(FileSystemWriter):
    """torch's ``FileSystemWriter`` writing into the folder ``location`` through its storage."""

    def __init__(self, location: Location, **kwargs):
        super().__init__(str(location), sync_files=False, **kwargs)
        self.fs = LocationFS()  # type: ignore[assignment]
        self.path = location  # type: ignore[assignment]

    @property
    def checkpoint_id(self):
        # Pickled into .metadata: a local checkpoint records its Path as torch's writer does;
        # another storage's location records its text (a Location holds a live storage).
        loc = self.path
        return loc.local_path("the checkpoint id") if loc.scheme is None else str(loc)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = _torch_fs.CURRENT_DCP_VERSION  # torch's own writer records its DCP format version
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        rank = self.rank if not self.use_collectives else None  # no_dist: every rank its own
        with self.fs.create_stream(self._get_metadata_path(rank), "wb") as stream:
            pickle.dump(metadata, stream)


class LocationReader(FileSystemReader):
    """torch's ``FileSystemReader`` reading the folder ``location`` through its storage."""

    def __init__(self, location: Location):
        super().__init__(str(location))
        self.fs = LocationFS()  # type: ignore[assignment]
        self.path = location  # type: ignore[assignment]


__all__ = ["LocationFS", "LocationReader", "LocationWriter"]
