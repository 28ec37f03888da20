"""Backend registry, in one process: names, auto, missing packages, missing devices."""

import subprocess
import sys

import pytest
import torch

import shardwise as sw
from shardwise import backends
from shardwise.backends.base import GlooBackend
from shardwise.holding import Holding


@pytest.fixture
def clean_backend():
    sw.shutdown_backend()
    yield
    sw.shutdown_backend()


def test_unknown_name_lists_known_ones():
    with pytest.raises(sw.errors.UnknownBackendError) as e:
        sw.init_backend("tpu9000")
    msg = str(e.value)
    assert "tpu9000" in msg
    for name in ("gloo", "nccl", "xla", "xla_spmd", "neuron", "neuron_xla"):
        assert name in msg


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend("gloo", GlooBackend)


def test_register_and_use_third_party_backend(clean_backend, monkeypatch):
    class MyBackend(GlooBackend):
        name = "mine"

    backends.register_backend("mine", MyBackend)
    try:
        assert "mine" in backends.available_backends()
        b = sw.init_backend("mine")
        assert isinstance(b, MyBackend) and b.world_size == 1
    finally:
        backends._registry.pop("mine", None)


def test_entry_point_backends_are_registered(monkeypatch):
    import importlib.metadata as md

    ep = md.EntryPoint(name="epgloo", value="shardwise.backends.base:GlooBackend",
                       group=backends.ENTRY_POINT_GROUP)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [ep] if group == ep.group else [])
    monkeypatch.setattr(backends, "_entry_points_loaded", False)
    try:
        assert "epgloo" in backends.available_backends()
        assert backends.get_backend_class("epgloo") is GlooBackend
    finally:
        backends._registry.pop("epgloo", None)


def test_auto_picks_gloo_here():
    assert backends.resolve_auto() == "gloo"


def test_init_is_idempotent_and_refuses_another_name(clean_backend):
    b = sw.init_backend("gloo")
    assert sw.init_backend("gloo") is b
    assert sw.init_backend("auto") is b
    with pytest.raises(sw.errors.BackendError, match="already initialised"):
        sw.init_backend("nccl")


def test_world_of_one_without_launcher(clean_backend, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    b = sw.init_backend("gloo")
    assert (b.name, b.dist_backend, b.device_type) == ("gloo", "gloo", "cpu")
    assert (b.rank, b.world_size, b.local_rank) == (0, 1, 0)
    assert b.device == torch.device("cpu")
    assert b.supports_dtensor and b.supports_gather and b.holding is Holding.DTENSOR
    t = torch.tensor([3.0])
    assert b.all_reduce(t).item() == 3.0
    mesh = b.mesh(tp=1)
    assert mesh.mesh_dim_names == ("tp",)


def test_mesh_product_must_equal_world(clean_backend):
    b = sw.init_backend("gloo")
    with pytest.raises(sw.errors.MeshError) as e:
        b.mesh(tp=2, dp_shard=2)
    assert "4" in str(e.value) and "world size is 1" in str(e.value)
    with pytest.raises(sw.errors.MeshError, match="unknown mesh axis pp"):
        b.mesh(pp=1)


def test_missing_torch_xla_is_backend_unavailable(clean_backend, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # makes `import torch_xla` fail
    with pytest.raises(sw.errors.BackendUnavailableError) as e:
        sw.init_backend("xla")
    assert "torch_xla" in str(e.value) and "pip install" in str(e.value)
    assert not backends.get_backend_class("xla").is_available()


@pytest.mark.parametrize("name", ["neuron", "neuron_xla"])
def test_missing_torch_neuronx_is_backend_unavailable(clean_backend, monkeypatch, name):
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    with pytest.raises(sw.errors.BackendUnavailableError) as e:
        sw.init_backend(name)
    assert "torch_neuronx" in str(e.value) and "Neuron" in str(e.value)
    assert f"backends/{name}/requirements.txt" in str(e.value)
    assert not backends.get_backend_class(name).is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_nccl_without_cuda_is_a_clear_error(clean_backend):
    with pytest.raises(sw.errors.BackendError) as e:
        sw.init_backend("nccl")
    assert "CUDA" in str(e.value) and "gloo" in str(e.value)
    assert backends.current_backend() is None


def test_incomplete_launcher_env_is_a_clear_error(clean_backend, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(sw.errors.BackendError, match="MASTER_ADDR"):
        sw.init_backend("gloo")


def test_import_shardwise_does_not_import_hardware_packages():
    code = ("import sys, shardwise; from shardwise import backends; backends.available_backends(); "
            "bad = [m for m in ('torch_xla', 'torch_neuronx') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_builtin_backends_are_imported_by_name_on_first_use():
    code = ("import sys, shardwise as sw; from shardwise import backends; "
            "names = backends.available_backends(); "
            "loaded = sorted(m for m in sys.modules if m.startswith('shardwise.backends.')); "
            "assert loaded == ['shardwise.backends.base', 'shardwise.backends.launch'], loaded; "
            "assert backends.get_backend_class('xla').__name__ == 'XlaBackend'; "
            "assert 'shardwise.backends.xla' in sys.modules; "
            "assert 'shardwise.backends.neuron' not in sys.modules; "
            "print(names)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == str(["gloo", "nccl", "neuron", "neuron_xla", "xla", "xla_spmd"])
