"""Mutations of checkpoint folders for the fuzzer (tests/stress/stress.py fuzz).

Three seed checkpoints of one small model, written by shardwise: a one-file safetensors
folder, a sharded one with its index, and a distributed (DCP) one saved at tp=2 (several
chunks per sharded tensor). A case copies one seed and applies one mutation chosen by a
``random.Random`` seeded with (run seed, case number), so any case can be replayed alone.
Mutations that point outside the folder aim at ``secret/``, beside the cases, so that the
fuzzer can tell a read outside the checkpoint from any other open.

Each mutation returns a short description; the kinds cover the header bytes and fields,
the length prefix, truncation, data bytes, index entries, the DCP data files, the
``.metadata`` objects and bytes, ``shardwise.json``, and files replaced by FIFOs,
folders and symlinks.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import struct
from pathlib import Path

_LONG = "x" * 5000
_NAMES = [_LONG, "\ud800", "", "../evil", "__metadata__", "名前", "a\nb", "w" * 300]
_BAD_VALUES = [-1, 0, 1, 2**40, 2**63, 1.5, "3", True, None, [], {}]


def _flip(data: bytearray, lo: int, hi: int, rng: random.Random, n: int = 0) -> str:
    if hi <= lo:
        return "nothing to flip"
    spots = []
    for _ in range(n or rng.randint(1, 3)):
        at = rng.randrange(lo, hi)
        data[at] ^= 1 << rng.randrange(8)
        spots.append(at)
    return f"flip bytes {spots}"


def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _mutate_entry(header: dict, rng: random.Random) -> str:
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    op = rng.randrange(9)
    if op == 0:
        entry["dtype"] = rng.choice(["F16", "I32", "BF16", "U8", "F64", "F7", 5, None, "f32"])
        return f"{name}.dtype={entry['dtype']!r}"
    if op == 1:
        shape = entry["shape"]
        if shape and rng.random() < 0.7:
            shape[rng.randrange(len(shape))] = rng.choice(_BAD_VALUES + [shape[0] + 1, max(shape[0] - 1, 0)])
        else:
            shape.append(rng.choice([1, 2, 0]))
        return f"{name}.shape={shape!r}"
    if op == 2:
        start, end = entry["data_offsets"]
        k = rng.choice([-8, -4, -1, 1, 2, 4, 8, 4096])
        entry["data_offsets"] = rng.choice([[start + k, end + k], [start, end + k], [start + k, end],
                                            [end, start], [start], [start, end, end], [0, 2**63],
                                            [float(start), end], [str(start), end]])
        return f"{name}.data_offsets={entry['data_offsets']!r}"
    if op == 3:
        key = rng.choice(["dtype", "shape", "data_offsets"])
        del entry[key]
        return f"del {name}.{key}"
    if op == 4:
        new = rng.choice(_NAMES)
        header[new] = header.pop(name)
        return f"rename {name} -> {new[:20]!r}"
    if op == 5:
        header["__metadata__"] = rng.choice([{"format": 5}, [], {"a": {"b": 1}}, "x", None])
        return f"__metadata__={header['__metadata__']!r}"
    if op == 6:
        del header[name]
        return f"remove {name}"
    if op == 7:
        header[name] = rng.choice([5, [], "x", None])
        return f"{name}={header[name]!r}"
    other = rng.choice(names)
    entry["data_offsets"] = list(header[other]["data_offsets"]) if isinstance(header[other], dict) else [0, 0]
    return f"{name} shares the offsets of {other}"


def mutate_safetensors(path: Path, rng: random.Random) -> str:
    """One mutation of the safetensors file ``path``."""
    op = rng.choice(["flip_header", "length", "field", "field", "field", "truncate", "append",
                     "flip_data", "bomb", "duplicate"])
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    if op == "flip_header":
        desc = _flip(raw, 8, 8 + n, rng)
    elif op == "length":
        new = rng.choice([n - rng.randint(1, 8), n + rng.randint(1, 8), 0, 1, len(raw), 2**63,
                          rng.getrandbits(64)])
        raw[:8] = struct.pack("<Q", new)
        desc = f"length {n} -> {new}"
    elif op == "field":
        _, header, data = _header(path)
        desc = _mutate_entry(header, rng)
        _write_header(path, header, data)
        return "field " + desc
    elif op == "truncate":
        cut = rng.randrange(len(raw))
        del raw[cut:]
        desc = f"truncate at {cut}"
    elif op == "append":
        raw += os.urandom(rng.randint(1, 64))
        desc = "append bytes"
    elif op == "flip_data":
        desc = "data " + _flip(raw, 8 + n, len(raw), rng, n=1)
    elif op == "bomb":
        _, _, data = _header(path)
        bomb = rng.choice([b"[" * 100_000 + b"]" * 100_000, b'{"a":"' + b"x" * 5_000_000 + b'"}',
                           json.dumps({f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
                                       for i in range(50_000)}).encode()])
        _write_header(path, bomb, data)
        return f"header bomb of {len(bomb)} bytes"
    else:
        text = raw[8:8 + n].decode("utf-8").rstrip()
        first = next(iter(json.loads(text)))
        dup = text[:-1] + "," + json.dumps(first) + ':{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
        _write_header(path, dup.encode(), bytes(raw[8 + n:]))
        return f"duplicate key {first}"
    path.write_bytes(bytes(raw))
    return f"{op}: {desc}"


def mutate_index(index: Path, rng: random.Random, secret: Path) -> str:
    """One mutation of a ``*.safetensors.index.json``."""
    content = json.loads(index.read_text())
    wm = content["weight_map"]
    name = rng.choice(list(wm))
    op = rng.randrange(6)
    if op == 0:
        wm[name] = rng.choice([f"../{secret.name}/secret.safetensors", str(secret / "secret.safetensors"),
                               _LONG + ".safetensors", "missing.safetensors", 5, None, "model.bin", "",
                               "a\0b.safetensors", rng.choice(sorted(set(wm.values())))])
        desc = f"weight_map[{name}] = {str(wm[name])[:40]!r}"
    elif op == 1:
        wm[rng.choice(_NAMES)] = wm.pop(name)
        desc = f"rename {name}"
    elif op == 2:
        del wm[name]
        desc = f"drop {name}"
    elif op == 3:
        content = rng.choice([[], "x", {"weight_map": []}, {"weight_map": {}}, {"metadata": {}}])
        desc = f"index = {content!r}"
    elif op == 4:
        index.write_text("[" * 100_000 + "]" * 100_000)
        return "deep nesting"
    else:
        raw = bytearray(index.read_bytes())
        desc = "index " + _flip(raw, 0, len(raw), rng)
        index.write_bytes(bytes(raw))
        return desc
    index.write_text(json.dumps(content))
    return desc


def mutate_files(folder: Path, rng: random.Random, secret: Path) -> str:
    """Replace a file of ``folder`` by a FIFO, a folder, a symlink out, or nothing."""
    victim = rng.choice(sorted(p for p in folder.iterdir() if p.is_file()))
    op = rng.choice(["fifo", "dir", "symlink", "delete"])
    victim.unlink()
    if op == "fifo":
        os.mkfifo(victim)
    elif op == "dir":
        victim.mkdir()
    elif op == "symlink":
        twin = secret / ("dcp" if victim.suffix == ".distcp" or victim.name == ".metadata" else "st")
        target = twin / victim.name
        victim.symlink_to(target if target.exists() else secret / "secret.safetensors")
    return f"{victim.name} -> {op}"


def mutate_dcp_metadata(folder: Path, rng: random.Random, secret: Path) -> str:
    """Change one object of a DCP ``.metadata`` (sizes, chunks, dtype, storage) and re-pickle it."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    fqn = rng.choice(list(metadata.state_dict_metadata))
    md = metadata.state_dict_metadata[fqn]
    chunk = rng.choice(md.chunks)
    k = rng.choice([-1, 1, 2, 16, 1000, 10**6])
    op = rng.randrange(9)

    def bump(size, dim=None):
        size = list(size)
        if size:
            i = rng.randrange(len(size)) if dim is None else dim
            size[i] = max(0, size[i] + k) if k < 1000 else size[i] * k
        return torch.Size(size)

    if op == 0:
        md.size = bump(md.size)
        desc = f"{fqn}.size={tuple(md.size)}"
    elif op == 1:
        chunk.sizes = bump(chunk.sizes)
        desc = f"{fqn} chunk sizes={tuple(chunk.sizes)}"
    elif op == 2:  # like a shared torch.Size changed in the pickle: both move together
        dim = rng.randrange(len(md.size)) if len(md.size) else None
        md.size, chunk.sizes = bump(md.size, dim), bump(chunk.sizes, dim)
        desc = f"{fqn} size and chunk sizes grown"
    elif op == 3:
        old = chunk.offsets
        chunk.offsets = bump(chunk.offsets)
        key = next(i for i in metadata.storage_data if i.fqn == fqn and tuple(i.offset) == tuple(old))
        info = metadata.storage_data.pop(key)
        metadata.storage_data[type(key)(fqn, chunk.offsets)] = info
        desc = f"{fqn} chunk moved to {tuple(chunk.offsets)}"
    elif op == 4:
        md.properties.dtype = rng.choice([torch.float16, torch.int32, torch.float64, torch.uint8, torch.bool])
        desc = f"{fqn}.dtype={md.properties.dtype}"
    elif op == 5:
        info = rng.choice(list(metadata.storage_data.values()))
        field = rng.choice(["offset", "length", "relative_path"])
        value = {"offset": rng.choice([info.offset + k, -1, 2**40]),
                 "length": rng.choice([0, info.length - k, info.length + k, 2**40]),
                 "relative_path": rng.choice([f"../{secret.name}/dcp/__0_0.distcp", "/etc/passwd",
                                              "missing.distcp", _LONG, "."])}[field]
        setattr(info, field, value)
        desc = f"storage {field}={str(value)[:40]}"
    elif op == 6:
        metadata.storage_data.pop(rng.choice(list(metadata.storage_data)))
        desc = "drop a storage entry"
    elif op == 7:
        if rng.random() < 0.5:
            md.chunks.append(rng.choice(md.chunks))
            desc = f"{fqn} chunk duplicated"
        else:
            md.chunks.remove(chunk)
            desc = f"{fqn} chunk dropped"
    else:
        metadata.state_dict_metadata[fqn] = rng.choice([BytesStorageMetadata(), 5, None])
        desc = f"{fqn} entry replaced"
    path.write_bytes(pickle.dumps(metadata))
    return "metadata " + desc


def mutate_dcp(folder: Path, rng: random.Random, secret: Path) -> str:
    """One mutation of a DCP folder: data files, ``.metadata``, ``shardwise.json``, files."""
    op = rng.choice(["distcp", "distcp", "objects", "objects", "objects", "pickle_bytes", "info",
                     "files"])
    if op == "objects":
        return mutate_dcp_metadata(folder, rng, secret)
    if op == "files":
        return mutate_files(folder, rng, secret)
    if op == "pickle_bytes":
        raw = bytearray((folder / ".metadata").read_bytes())
        desc = _flip(raw, 0, len(raw), rng)
        (folder / ".metadata").write_bytes(bytes(raw))
        return ".metadata " + desc
    if op == "info":
        return mutate_info(folder / "shardwise.json", rng)
    data = rng.choice(sorted(folder.glob("*.distcp")))
    raw = bytearray(data.read_bytes())
    how = rng.choice(["flip", "flip", "truncate", "append", "zero"])
    if how == "flip":
        desc = _flip(raw, 0, len(raw), rng)
    elif how == "truncate":
        del raw[rng.randrange(len(raw)):]
        desc = "truncated"
    elif how == "append":
        raw += os.urandom(rng.randint(1, 100))
        desc = "appended"
    else:
        at = rng.randrange(len(raw))
        raw[at:at + 64] = bytes(len(raw[at:at + 64]))
        desc = f"zeroed at {at}"
    data.write_bytes(bytes(raw))
    return f"{data.name} {desc}"


def mutate_info(path: Path, rng: random.Random) -> str:
    info = json.loads(path.read_text())
    op = rng.randrange(5)
    if op == 0:
        key = rng.choice(list(info))
        info[key] = rng.choice(_BAD_VALUES + ["x", {"a": 1}])
        path.write_text(json.dumps(info))
        return f"shardwise.json {key}={str(info[key])[:30]}"
    if op == 1:
        path.write_text("[" * 100_000 + "]" * 100_000)
        return "shardwise.json deep nesting"
    if op == 2:
        path.unlink()
        os.mkfifo(path)
        return "shardwise.json fifo"
    if op == 3:
        with open(path, "r+b") as f:
            f.truncate(200_000_000)  # sparse: over the 100 MB cap without writing it
        return "shardwise.json over the size cap"
    sums = info.get("checksums", {}).get("chunks") or info.get("checksums", {}).get("tensors") or {}
    if sums:
        name = rng.choice(list(sums))
        sums[name] = rng.choice(["zz", 5, {}, "00000000"]) if not isinstance(sums[name], dict) else {"0": "q"}
    path.write_text(json.dumps(info))
    return "shardwise.json checksums changed"


def new_case(seeds: Path, secret: Path, case_dir: Path, rng: random.Random) -> tuple[str, Path, str]:
    """Copy a seed into ``case_dir`` and mutate it: ``(seed name, checkpoint path, description)``."""
    seed = rng.choice(["one", "sharded", "sharded", "dcp", "dcp", "dcp"])
    folder = case_dir / "ckpt"
    shutil.copytree(seeds / seed, folder)
    if seed == "dcp":
        return seed, folder, mutate_dcp(folder, rng, secret)
    op = rng.random()
    if op < 0.15:
        return seed, folder, mutate_files(folder, rng, secret)
    if seed == "sharded" and op < 0.4:
        return seed, folder, mutate_index(next(folder.glob("*.index.json")), rng, secret)
    if op < 0.45:
        return seed, folder, mutate_info(folder / "shardwise.json", rng)
    victim = rng.choice(sorted(folder.glob("*.safetensors")))
    return seed, folder, f"{victim.name}: " + mutate_safetensors(victim, rng)


__all__ = ["new_case"]
