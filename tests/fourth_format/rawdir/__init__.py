"""rawdir: a fourth checkpoint format, as one folder, for the registry's test. A checkpoint is a
folder with ``rawdir.json`` (``{"format": "rawdir", "tensors": {name: {"dtype", "shape",
"file"}}}``) and one file per tensor holding its bytes in C order. The reader reads each box a
rank wants as byte runs through the Storage (``core.header.region_runs``); the writer is a
gathered ``FileSink`` (sw.save gathers every tensor to rank 0, which writes one file each; the
save's transaction writes the index last). Registered with one line:
``register_format("rawdir", "fourth_format.rawdir")``.
"""

from __future__ import annotations

import math

import torch

from shardwise.core.header import region_runs, str_to_dtype
from shardwise.core.spec import Region, local_layout
from shardwise.errors import CheckpointError
from shardwise.io.formats import Capabilities
from shardwise.io.info import digest_hex, digest_range, record_checksums
from shardwise.io.sink import PlannedFile, WritePlan
from shardwise.io.source import Blob, Description, Reads
from shardwise.io.storage import Handles, byte_view, locate, read_json

NAME = "rawdir"
CAPABILITIES = Capabilities(label="rawdir", files=("*.raw", "rawdir.json"))  # what a save may replace
INDEX = "rawdir.json"


def claims(path) -> bool:
    try:
        return (locate(path) / INDEX).stat() is not None
    except NotADirectoryError:  # a file: not a rawdir folder
        return False


def open_source(path, **options):
    return RawDirSource(path)


def writer(*, metadata=None, **options):
    """The file sink; the gather save's other options (file size, prefix) do not apply."""
    return RawDirSink()


class RawDirSource:
    """Source and Stored over the storage: every read is a batch of byte runs of one file."""

    name = NAME

    def __init__(self, path):
        self.root, self.bytes_read = locate(path), 0
        listing = read_json(self.root / INDEX, what="a rawdir index")
        if listing.get("format") != NAME:
            raise CheckpointError(f"{self.root / INDEX}: not a rawdir index")
        self._tensors = listing["tensors"]
        self._handles = Handles()

    def tensors(self):
        return {n: (str_to_dtype(t["dtype"]), tuple(t["shape"])) for n, t in self._tensors.items()}

    def read_box(self, name, box: Region) -> torch.Tensor:
        dtype, shape = self.tensors()[name]
        out = torch.empty(box.sizes, dtype=dtype)
        runs = region_runs(shape, dtype.itemsize, box.offsets, box.sizes)
        if runs:
            self._handles.get(self.root / self._tensors[name]["file"]).read_runs(byte_view(out), 0, runs)
        return out

    def describe(self):
        return Description("rawdir", tuple(t["file"] for t in self._tensors.values()))

    def blobs(self):
        for name, (dtype, shape) in self.tensors().items():
            handle = self._handles.get(self.root / self._tensors[name]["file"])
            nbytes = math.prod(shape) * dtype.itemsize
            yield Blob(name, None, nbytes,
                       lambda algorithm, h=handle, n=nbytes: (digest_range(h, 0, n, algorithm), None))

    def use_module_names(self, wanted):
        pass

    def close(self):
        self._handles.close()

    # --- sw.load ---
    def match(self, model, specs, *, strict: bool):
        own, stored = model.state_dict(keep_vars=True), self.tensors()
        for n in specs:
            if n in stored and stored[n][1] != tuple(own[n].shape):
                raise CheckpointError(f"{self.root}: {n!r} is {stored[n][1]} here but "
                                      f"{tuple(own[n].shape)} in the model")
        missing = [n for n in specs if n not in stored]
        if strict and missing:
            raise CheckpointError(f"{self.root}: missing {missing}")
        return missing, [k for k in stored if k not in specs and k not in specs.aliases]

    def plan(self, wants) -> Reads:
        layouts = {}
        for key, w in wants.items():
            if w.tie is not None:
                raise CheckpointError("rawdir holds no quantized tensors")
            layouts[key] = local_layout(self.tensors()[w.name][1], w.spec, w.degree, w.rank)
        nbytes = sum(r.numel * self.tensors()[w.name][0].itemsize
                     for key, w in wants.items() for r, _ in layouts[key])
        return Reads(wants, nbytes, layouts)

    def read(self, reads: Reads, *, finalize, options, on_bytes=None):
        out = {}
        for key, w in reads.wants.items():
            layout = reads.detail[key]
            dtype = self.tensors()[w.name][0]
            extent = tuple(max(o[d] + r.sizes[d] for r, o in layout) for d in range(len(layout[0][1])))
            local = torch.empty(extent, dtype=dtype)
            for region, off in layout:
                local[Region(off, region.sizes).slices()] = self.read_box(w.name, region)
                self.bytes_read += region.numel * dtype.itemsize
                if on_bytes is not None:
                    on_bytes(region.numel * dtype.itemsize)
            if options.dtype is not None and dtype.is_floating_point:
                local = local.to(options.dtype)
            out[key] = finalize(key, local)
        return out


class RawDirSink:
    """One file per tensor, named by its place; the index lists them."""

    def plan(self, stored) -> WritePlan:
        files = tuple(PlannedFile(f"{i:05d}.raw", (s.spec,)) for i, s in enumerate(stored))
        listing = {s.name: {"dtype": s.dtype, "shape": list(s.shape), "file": f.name}
                   for s, f in zip(stored, files, strict=True)}
        index = {"format": NAME, "tensors": listing}
        return WritePlan(files, {}, (INDEX, index), {s.name: s.part for s in stored if s.part is not None})

    def open_file(self, location, tensors, header):
        return RawFile(location.create())


class RawFile:
    def __init__(self, out):
        self.out, self.checksums = out, {}

    def write(self, name, tensor):
        data = byte_view(tensor.contiguous())
        self.out.write(data)
        self.checksums[name] = digest_hex(data)

    def close(self):
        self.out.commit()
        record_checksums(self.checksums)

    def abort(self):
        self.out.abort()


__all__ = ["CAPABILITIES", "NAME", "claims", "open_source", "writer"]
