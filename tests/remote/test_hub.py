"""Hub repo ids and fsspec URLs: ``sw.from_pretrained(cls, "org/tiny", revision=...)`` against a
local stand-in for the hub (tests/remote/hub_server.py, which counts the bytes it sends), on 2
gloo ranks that each fetch only their own byte ranges; the errors for an unknown repo or
revision and for a read-only URL; and the verbs over fsspec's ``memory://`` filesystem (process
local: one process), its save transaction complete or absent."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys

import pytest

pytest.importorskip("fsspec", reason="fsspec URLs need fsspec (tox -e remote installs it)")

import torch  # noqa: E402
from hub_server import HubServer  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise.errors import CheckpointError, UsageError  # noqa: E402
from shardwise.hf.pretrained import is_repo_id  # noqa: E402
from shardwise.io.storage import locate  # noqa: E402
from shardwise.testing import spawn  # noqa: E402

REPO = "org/tiny"
TOKENS = torch.arange(12).reshape(2, 6)


def _save_tiny(folder) -> None:
    """A tiny Llama, saved by transformers in several files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="60KB")


def test_a_repo_id_is_org_slash_name_where_no_local_path_has_that_name(tmp_path, monkeypatch):
    assert is_repo_id("org/tiny") and is_repo_id("Org-1/tiny_v2.5")
    for other in ("tiny", "org/tiny/extra", "./org/tiny", "/org/tiny", "org//tiny", "hf://org/tiny",
                  "org--x/tiny", "org/ti..ny", "org/-tiny"):
        assert not is_repo_id(other), other
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id("org/tiny")  # a local folder of that name wins, as in transformers


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.fixture
def hub(tmp_path):
    # found, not imported: the ranks unpickle this module before they set HF_ENDPOINT, and
    # huggingface_hub (which transformers imports) reads it once, at its import
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("hub loads need transformers (tox -e remote installs it)")
    from models import make_model

    _save_tiny(tmp_path / "tiny")
    sw.save(make_model(), tmp_path / "single")  # one model.safetensors, for the https:// test
    server = HubServer({REPO: tmp_path / "tiny", "org/single": tmp_path / "single"}).start()
    yield server
    server.stop()


def _env(hub, tmp_path) -> dict[str, str]:
    # huggingface_hub reads these at import: the ranks get them before they import it
    return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _from_hub_and_folder(folder: str) -> tuple[bool, int]:
    from transformers import AutoModelForCausalLM

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=2)
    remote = sw.from_pretrained(AutoModelForCausalLM, REPO, revision="main", mesh=mesh)
    local = sw.from_pretrained(AutoModelForCausalLM, folder, mesh=mesh)
    return torch.equal(_logits(remote), _logits(local)), remote.result.bytes_read


def test_a_hub_repo_id_loads_at_tp2_each_rank_fetching_its_own_ranges(hub, tmp_path):
    folder = tmp_path / "tiny"
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) > 2
    data = sum(p.stat().st_size for p in files)
    headers = sum(_header_bytes(p) for p in files)
    rows = spawn(_from_hub_and_folder, 2, args=(str(folder),), env=_env(hub, tmp_path), timeout=300)
    assert all(equal for equal, _ in rows), "the logits of the hub load differ from the folder's"
    sent = sum(n for path, n in hub.sent.items() if path.endswith(".safetensors"))
    # every rank reads every header and its own slices (the replicated norms both): the whole
    # job fetches the data about once, never a copy per rank
    assert sent < 2 * data
    assert sent <= 1.1 * (data - headers) + 2 * headers, (sent, data, headers)
    read = sum(n for _, n in rows)  # what the loaders report: their slices, headers aside
    assert read <= sent <= 1.05 * read + 2 * headers
    # every byte through ranged GETs of one pinned commit: none of a whole file, none at "main"
    gets = [(p, r) for m, p, r in hub.requests if m == "GET" and "/resolve/" in p]
    assert gets and all(r is not None and r.startswith("bytes=") for _, r in gets)
    assert not any("/resolve/main/" in p for p, _ in gets)


RIGHT, WRONG = "hf_right_token_5b1f", "hf_wrong_token_9c2e"


def _errors() -> tuple[list[str], int]:
    from transformers import AutoModelForCausalLM

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=1)
    messages = []
    for repo, revision, token in (("org/absent", "main", None), (REPO, "no-such-branch", None),
                                  (REPO, "main", WRONG)):
        try:
            sw.from_pretrained(AutoModelForCausalLM, repo, revision=revision, token=token, mesh=mesh)
        except CheckpointError as e:
            messages.append(str(e))
    model = sw.from_pretrained(AutoModelForCausalLM, REPO, mesh=mesh)  # HF_TOKEN: the right one
    return messages, model.result.tensors


def test_unknown_repos_revisions_and_tokens_are_one_clear_error_each(hub, tmp_path):
    hub.token = RIGHT  # a private repo: the API and every file ask for it
    [(messages, tensors)] = spawn(_errors, 1, env={**_env(hub, tmp_path), "HF_TOKEN": RIGHT}, timeout=180)
    assert len(messages) == 3, messages
    assert "'org/absent'" in messages[0] and "no model repo" in messages[0] and "token" in messages[0]
    assert "no revision 'no-such-branch'" in messages[1] and REPO in messages[1]
    assert "refused access" in messages[2] and "HTTP 401" in messages[2] and "token=" in messages[2]
    assert not any(t in m for m in messages for t in (RIGHT, WRONG))  # no token in any message
    assert tensors > 0  # the token of HF_TOKEN reached the API and the ranged reads


def _https_load(url: str) -> bool:
    import shardwise.testing
    from models import make_model, tiny_plan

    backend = sw.init_backend("gloo")
    with torch.device("meta"):
        model = make_model()
    sw.load(model, url, plan=tiny_plan(), mesh=backend.mesh(tp=1))
    want = make_model().state_dict()
    return all(torch.equal(shardwise.testing.local_shard(t), want[n]) for n, t in model.state_dict().items())


def test_an_https_url_of_one_file_loads_and_a_save_there_is_refused(hub, tmp_path):
    url = f"{hub.endpoint}/org/single/resolve/main/model.safetensors"
    try:
        import aiohttp  # noqa: F401 - fsspec's HTTP filesystem needs it
    except ImportError:
        with pytest.raises(UsageError, match="aiohttp"):
            locate(url)
        pytest.skip("fsspec's http:// needs aiohttp (tox -e remote installs it): checked its absence only")
    with pytest.raises(UsageError, match="cannot save to http://"):
        sw.save(torch.nn.Linear(2, 2), f"{hub.endpoint}/org/single/out")
    hub.clear()
    assert spawn(_https_load, 1, args=(url,), timeout=180) == [True]
    size = (tmp_path / "single" / "model.safetensors").stat().st_size
    assert 0 < hub.sent["org/single/model.safetensors"] <= size  # ranged reads, the file once


def test_read_only_and_unknown_schemes_are_clear_errors(monkeypatch):
    model = torch.nn.Linear(2, 2)
    if importlib.util.find_spec("huggingface_hub") is not None:  # fsspec's hf:// is its HfFileSystem
        with pytest.raises(UsageError, match=r"cannot save to hf://.*upload_folder"):
            sw.save(model, "hf://org/tiny/out")
    with pytest.raises(UsageError, match=r"no storage for the scheme 'nosuch'.*memory"):
        locate("nosuch://bucket/ckpt")
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as where fsspec is not installed
    with pytest.raises(UsageError, match="pip install fsspec"):
        locate("otherscheme://bucket/ckpt")


def _memory_verbs(root: str) -> dict:
    import shardwise.testing
    from models import make_model, tiny_plan

    backend = sw.init_backend("gloo")
    source = make_model()
    sw.save(source, "memory://sw/src", max_shard_size=40_000)
    sw.save(source, f"{root}/src", max_shard_size=40_000)
    with torch.device("meta"):
        model = make_model()
    sw.load(model, "memory://sw/src", plan=tiny_plan(), mesh=backend.mesh(tp=1))
    want = source.state_dict()
    loaded = all(torch.equal(shardwise.testing.local_shard(t), want[n])
                 for n, t in model.state_dict().items())
    sw.save(model, "memory://sw/dcp", distributed=True)
    sw.consolidate("memory://sw/dcp", f"{root}/merged", max_shard_size=40_000)
    import fsspec

    memory = fsspec.filesystem("memory")
    stored = {p.rpartition("/")[2]: memory.cat_file(p) for p in memory.find("/sw/src")}
    return {"loaded": loaded, "verified": sw.verify("memory://sw/dcp").ok,
            "identical": sw.diff("memory://sw/dcp", f"{root}/src").identical,
            "stored": stored, "left": sorted(memory.find("/sw", withdirs=True))}


def test_the_verbs_over_fsspec_memory(tmp_path):
    [row] = spawn(_memory_verbs, 1, args=(str(tmp_path),), timeout=180)
    assert row["loaded"] and row["verified"] and row["identical"]
    local = {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()}
    assert row["stored"] == local  # the save through fsspec: byte for byte the local one
    merged = {p.name: p.read_bytes() for p in (tmp_path / "merged").iterdir()}
    assert merged == local
    assert not [p for p in row["left"] if "shardwise-" in p], row["left"]  # no staging, no journal


def test_a_memory_save_is_complete_or_absent():
    """A save stopped after staging leaves the previous checkpoint, whole; the next completes."""
    import fsspec

    memory = fsspec.filesystem("memory")
    target = locate("memory://txn/ckpt")
    index = "model.safetensors.index.json"

    def save(tag: bytes, *, stop: bool) -> None:
        txn = target.storage.transaction(target, overwrite=True, replaceable=("*.safetensors", "*.json"))
        try:
            txn.prepare()
            for name in ("a.safetensors", "b.safetensors"):
                (txn.folder / name).write_bytes(tag * 100)
            if stop:
                raise KeyboardInterrupt("killed after staging")
            txn.commit((index, {"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}))
        finally:
            txn.discard()

    def read() -> dict[str, bytes]:
        return {n: bytes(memory.cat_file(f"/txn/ckpt/{n}")) for n in target.list()}

    save(b"1", stop=False)
    first = read()
    assert sorted(first) == ["a.safetensors", "b.safetensors", index]
    with pytest.raises(KeyboardInterrupt):
        save(b"2", stop=True)
    assert read() == first
    save(b"3", stop=False)
    assert read()["a.safetensors"] == b"3" * 100 and json.loads(read()[index])["weight_map"]
    assert not [p for p in memory.find("/txn", withdirs=True) if "shardwise-" in p]


def test_a_file_url_saves_what_a_local_path_saves(tmp_path):
    """``file://`` through fsspec's local filesystem: the same files, and nothing left beside."""
    from models import make_model

    model = make_model()
    sw.save(model, tmp_path / "local", max_shard_size=40_000)
    for _ in range(2):  # a new checkpoint, then one over it
        sw.save(model, f"file://{tmp_path}/url", max_shard_size=40_000, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "url"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "url").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert sw.verify(f"file://{tmp_path}/url").ok


def test_a_memory_object_cut_under_its_reader_is_an_error_not_short_data():
    """Every body is checked for its length: an object replaced by a shorter one after it was
    opened is retried, then a CheckpointError naming it; never a short read."""
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe_file("/cut/blob.bin", bytes(range(256)) * 8)
    handle = locate("memory://cut/blob.bin", {"retries": 1}).open()
    buf = bytearray(1024)
    assert handle.read_runs(memoryview(buf), 1024, [(0, 512), (512, 512)]) == 1024
    assert bytes(buf) == (bytes(range(256)) * 8)[1024:]
    memory.pipe_file("/cut/blob.bin", b"short")
    with pytest.raises(CheckpointError, match=r"memory://cut/blob.bin bytes \[1024, 2048\).*failed 2 times"):
        handle.read_runs(memoryview(buf), 1024, [(0, 512), (512, 512)])
