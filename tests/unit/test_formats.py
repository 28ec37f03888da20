"""The registry of checkpoint formats (``shardwise.io.formats``): its order, its refusals, and
that a new format is one plugin plus one registry line: a toy format registered here is
inspected, verified, diffed and consolidated by the same tools, with no other change."""

import json
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardwise as sw
from shardwise.core.header import dtype_to_str, str_to_dtype
from shardwise.errors import CheckpointError, UsageError
from shardwise.io import formats
from shardwise.io.check import inspect_checkpoint
from shardwise.io.formats.sharded.source import sharding_metadata
from shardwise.io.info import digest_hex
from shardwise.io.source import Blob, Description
from shardwise.io.storage import read_small

TENSORS = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3),
           "b": torch.tensor([1, 2, 3], dtype=torch.int64)}


@pytest.fixture
def registry():
    """The registry, restored after the test."""
    saved = dict(formats.FORMATS)
    yield formats.FORMATS
    formats.FORMATS.clear()
    formats.FORMATS.update(saved)


def test_order_and_refusals(registry):
    assert list(registry) == ["dcp", "sharded", "safetensors"]
    with pytest.raises(UsageError, match=r"no checkpoint format named 'nope'.*dcp, sharded, safetensors"):
        formats.get_format("nope")
    with pytest.raises(UsageError, match=r"'dcp' is already registered.*known formats: dcp, sharded"):
        formats.register_format("dcp", "somewhere")
    with pytest.raises(UsageError, match=r"no checkpoint format named 'nope' to insert 'x' before"):
        formats.register_format("x", "somewhere", before="nope")
    formats.register_format("x", "somewhere")
    assert list(registry) == ["dcp", "sharded", "x", "safetensors"]


def test_torch_dcp_is_imported_only_to_open_a_dcp_checkpoint(tmp_path):
    """torch.distributed.checkpoint (~1.7 s to import after torch) stays off ``import shardwise``,
    the gather save, and inspect / verify / diff of a safetensors checkpoint, though the
    registry asks the DCP plugin about every path; opening a DCP checkpoint imports it."""
    code = ("import sys, torch, shardwise as sw\n"
            "dcp = lambda: 'torch.distributed.checkpoint' in sys.modules\n"
            "seen = [dcp()]\n"
            "sw.save(torch.nn.Linear(3, 4), sys.argv[1], progress=False)\n"
            "seen.append(dcp())\n"
            "sw.inspect(sys.argv[1]); sw.verify(sys.argv[1]); sw.diff(sys.argv[1], sys.argv[1])\n"
            "seen.append(dcp())\n"
            "sw.save(torch.nn.Linear(3, 4), sys.argv[2], distributed=True)\n"
            "print(seen + [dcp()])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "st"), str(tmp_path / "dcp")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[False, False, False, True]"


def test_a_safetensors_load_and_parallelize_leave_torch_dcp_unimported(tmp_path):
    """The load pipeline, its placement and ``parallelize`` import no DCP module: a safetensors
    load in a fresh process leaves ``torch.distributed.checkpoint`` (and its async saver's
    torch.distributed.elastic) out of ``sys.modules``."""
    code = ("import sys, torch, shardwise as sw\n"
            "from safetensors.torch import save_file\n"
            "new = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
            "save_file(new().state_dict(), sys.argv[1])\n"
            "mesh = sw.init_backend('gloo').mesh(tp=1)\n"
            "plan = {'0': 'colwise', '1': 'rowwise'}\n"
            "with torch.device('meta'):\n"
            "    model = new()\n"
            "result = sw.load(model, sys.argv[1], plan=plan, mesh=mesh)\n"
            "sw.parallelize(new(), plan, mesh)\n"
            "dcp = ('torch.distributed.checkpoint', 'torch.distributed.elastic',\n"
            "       'shardwise.io.formats.dcp.')\n"
            "print(result.tensors, sorted(m for m in sys.modules if m.startswith(dcp)))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # the last line: torch 2.9's gloo prints "[Gloo] Rank 0 is connected to ..." to stdout
    assert out.stdout.strip().splitlines()[-1] == "4 []"


def test_each_format_claims_its_own(tmp_path):
    save_file(TENSORS, tmp_path / "model.safetensors")
    (tmp_path / "sharded").mkdir()
    save_file({"w": TENSORS["w"][:2]}, tmp_path / "sharded" / "shard-00001-model-00001-of-00001.safetensors",
              metadata=sharding_metadata({"w": (0, 0)}))
    save_file({"w": TENSORS["w"][2:]}, tmp_path / "sharded" / "shard-00002-model-00001-of-00001.safetensors",
              metadata=sharding_metadata({"w": (2, 0)}))
    model = torch.nn.Linear(3, 4)
    sw.save(model, tmp_path / "dcp", distributed=True)
    opened = {}
    for name in ("model.safetensors", "sharded", "dcp"):
        source = formats.open_source(tmp_path / name)
        try:
            opened[name] = (source.name, sorted(source.tensors()))
        finally:
            source.close()
    assert opened == {"model.safetensors": ("safetensors", ["b", "w"]), "sharded": ("sharded", ["w"]),
                      "dcp": ("dcp", ["bias", "weight"])}
    for name in ("sharded", "dcp"):  # only ordinary safetensors dequantize FP8 weights
        with pytest.raises(UsageError, match="dequantize=True reads FP8 safetensors"):
            formats.open_source(tmp_path / name, dequantize=True)
    (tmp_path / "dcp" / ".metadata").unlink()  # still DCP by its file names, but incomplete
    report = sw.verify(tmp_path / "dcp")
    assert report.kind == "dcp" and not report.ok and "incomplete" in report.problems[0]


# --- a toy format: one folder of raw tensor files and a raw.json listing them ------------------

class RawSource:
    """A Source for the offline tools only (no ``match``/``plan``/``read``: nothing loads it)."""

    name = "raw"

    def __init__(self, path):
        self.root, self.bytes_read = path, 0  # a Location: read through its storage
        self.listing = json.loads(read_small(self.root / "raw.json", what="the listing"))

    def tensors(self):
        return {n: (str_to_dtype(t["dtype"]), tuple(t["shape"])) for n, t in self.listing.items()}

    def _whole(self, name):
        dtype, shape = self.tensors()[name]
        data = bytearray(read_small(self.root / f"{name}.bin", what="a tensor"))
        return torch.frombuffer(data, dtype=dtype).reshape(shape)

    def read_box(self, name, box):
        return self._whole(name)[box.slices()].clone()

    def describe(self):
        return Description("raw test format", tuple(f"{n}.bin" for n in self.listing))

    def blobs(self):
        for name in self.listing:
            data = read_small(self.root / f"{name}.bin", what="a tensor")
            yield Blob(name, None, len(data),
                       lambda algorithm, data=data: (digest_hex(data, algorithm), None))

    def use_module_names(self, wanted):
        pass

    def close(self):
        pass


def _raw_plugin() -> types.ModuleType:
    plugin = types.ModuleType("raw_format_plugin")
    plugin.NAME, plugin.CAPABILITIES = "raw", formats.Capabilities(label="raw")  # read only: no writer
    plugin.claims = lambda path: (path / "raw.json").stat() is not None
    plugin.open_source = lambda path, **options: RawSource(path)
    return plugin


def test_a_new_format_is_one_plugin_and_one_line(tmp_path, registry, monkeypatch):
    raw = tmp_path / "raw"
    raw.mkdir()
    for name, t in TENSORS.items():
        (raw / f"{name}.bin").write_bytes(t.numpy().tobytes())
    (raw / "raw.json").write_text(json.dumps(
        {n: {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape)} for n, t in TENSORS.items()}))
    (raw / "config.json").write_text("{}")  # a side file: consolidation copies it
    monkeypatch.setitem(sys.modules, "raw_format_plugin", _raw_plugin())
    with pytest.raises(CheckpointError):  # unregistered: the ordinary safetensors reader finds none
        inspect_checkpoint(raw)
    formats.register_format("raw", "raw_format_plugin")  # the one line

    report = inspect_checkpoint(raw)
    assert report.kind == "raw test format"
    assert [(n, d, s) for n, d, s, _ in report.tensors] == [("w", "F32", (4, 3)), ("b", "I64", (3,))]
    assert sw.verify(raw).ok
    merged = sw.consolidate(raw, tmp_path / "merged")
    assert sorted(p.name for p in merged.iterdir()) == ["config.json", "model.safetensors", "shardwise.json"]
    back = load_file(merged / "model.safetensors")
    assert all(torch.equal(back[n], t) for n, t in TENSORS.items())
    assert sw.verify(merged).ok
    assert sw.diff(raw, merged).identical
    (raw / "w.bin").write_bytes(torch.zeros(4, 3).numpy().tobytes())
    changed = sw.diff(raw, merged)
    assert [d.name for d in changed.differ] == ["w"] and changed.same == 1


def test_save_asks_the_registry_for_the_writer(tmp_path, registry, monkeypatch):
    """One vocabulary: sw.save's spellings map to the registry's names in one place, and a
    read-only format (no writer) or a format of the other kind is refused before anything
    is written."""
    assert formats.save_format(None, distributed=False).NAME == "safetensors"
    assert formats.save_format(None, distributed=True).NAME == "dcp"
    assert formats.save_format("distcp", distributed=True).NAME == "dcp"
    assert formats.save_format("safetensors", distributed=True).NAME == "sharded"
    assert formats.get_format("dcp").CAPABILITIES.async_save
    assert not formats.get_format("sharded").CAPABILITIES.async_save
    monkeypatch.setitem(sys.modules, "raw_format_plugin", _raw_plugin())
    formats.register_format("raw", "raw_format_plugin")
    with pytest.raises(UsageError, match="the raw format is read only.*writable formats: dcp, sharded"):
        sw.save(torch.nn.Linear(3, 4), tmp_path / "out", format="raw")
    with pytest.raises(UsageError, match="format='dcp' writes a distributed checkpoint"):
        formats.save_format("dcp", distributed=False)
    assert not (tmp_path / "out").exists()
