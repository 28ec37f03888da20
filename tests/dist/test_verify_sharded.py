"""``sw.verify`` and ``sw.diff`` on a distributed checkpoint in safetensors (rank-local files
with DCP_SHARDING_INFO): every chunk against the CRC-32 recorded when it was written, and
tensor by tensor against a gather save of the same weights."""

from __future__ import annotations

import shardwise as sw
from harness import run_ranks
from models import make_model, tiny_plan


def _save(folder: str):
    backend = sw.init_backend("gloo")
    model = make_model()
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=2))
    sw.save(model, folder, distributed=True, format="safetensors")
    sw.save(model, f"{folder}-full")  # the same weights, gathered
    return True


def test_verify_catches_one_flipped_byte_in_any_chunk(tmp_path):
    folder = tmp_path / "ckpt"
    assert run_ranks(_save, 2, str(folder)) == [True, True]
    report = sw.verify(folder)
    assert report.ok and report.kind == "sharded safetensors" and report.checksummed > 36, report.summary()
    same = sw.diff(folder, tmp_path / "ckpt-full")  # any two layouts, tensor by tensor
    assert same.identical and same.same == 36, same.summary()
    last = sorted(folder.glob("shard-*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    data[-3] ^= 0x01  # a byte of the last chunk of this file
    last.write_bytes(bytes(data))
    report = sw.verify(folder)
    assert not report.ok and len(report.mismatched) == 1, report.summary()
    assert not sw.diff(folder, tmp_path / "ckpt-full").identical
