"""Which Neuron backend a host gets, and the errors of the wrong one, against fake torch_neuronx
packages (tests/fakes) in this process: ``neuron`` for TorchNeuron (torch-neuronx 2.13, native),
``neuron_xla`` for the torch_xla-based torch-neuronx (2.9), neither for PyPI's placeholder or a
host without NeuronCores. Detection reads package metadata and sysfs only: it imports neither
torch_neuronx nor torch_xla. No process group is started here; init, placement and loads run on
spawned ranks in tests/dist/test_neuron_fake_ranks.py and test_neuron_native_fake.py."""

import sys

import pytest

import shardwise as sw
from fakes import NEURON_NATIVE, NEURON_PLACEHOLDER, NEURON_XLA, XLA
from shardwise import backends
from shardwise.backends import current_backend, neuron

_FAKED = ("torch_neuronx", "torch_xla")


def _drop_faked_modules():
    for name in [m for m in sys.modules if m.split(".")[0] in _FAKED]:
        del sys.modules[name]


def _imported() -> list[str]:
    return sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in _FAKED})


@pytest.fixture
def neuron_host(tmp_path, monkeypatch):
    """A host as the neuron backends see it: package folders first on sys.path, a sysfs tree;
    returns a function adding NeuronCores to that tree. Every faked module goes afterwards."""
    sw.shutdown_backend()
    monkeypatch.setattr(neuron, "NEURON_SYSFS", tmp_path / "neuron_device")
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")  # what importing the torch_xla-based torch_neuronx sets
    saved = {m: sys.modules[m] for m in list(sys.modules) if m.split(".")[0] in _FAKED}
    _drop_faked_modules()

    def add_device(index: int, cores: int):
        device = tmp_path / "neuron_device" / f"neuron{index}"
        device.mkdir(parents=True)
        (device / "core_count").write_text(f"{cores}\n")

    yield add_device
    sw.shutdown_backend()
    _drop_faked_modules()
    sys.modules.update(saved)


def test_auto_picks_neuron_xla_for_the_torch_xla_based_torch_neuronx(neuron_host, monkeypatch):
    monkeypatch.syspath_prepend(XLA)
    monkeypatch.syspath_prepend(NEURON_XLA)
    neuron_host(0, 2)
    neuron_host(1, 2)
    assert neuron.neuron_core_count() == 4 and neuron.torch_neuronx_version() == (2, 9)
    assert backends.get_backend_class("neuron_xla").is_available()
    assert not backends.get_backend_class("neuron").is_available()
    assert backends.resolve_auto() == "neuron_xla"


def test_auto_picks_neuron_for_torchneuron_without_importing_it_or_torch_xla(neuron_host, monkeypatch):
    monkeypatch.syspath_prepend(XLA)  # importable, and must stay unimported
    monkeypatch.syspath_prepend(NEURON_NATIVE)
    neuron_host(0, 8)
    assert neuron.torch_neuronx_version() == (2, 13)
    assert backends.get_backend_class("neuron").is_available()
    assert not backends.get_backend_class("neuron_xla").is_available()
    assert backends.resolve_auto() == "neuron"
    assert _imported() == []


@pytest.mark.parametrize("native", [True, False])
def test_no_neuroncore_means_not_available_and_a_clear_start_error(neuron_host, monkeypatch, native):
    monkeypatch.syspath_prepend(XLA)
    monkeypatch.syspath_prepend(NEURON_NATIVE if native else NEURON_XLA)
    name = "neuron" if native else "neuron_xla"
    assert neuron.neuron_core_count() == 0
    assert not backends.get_backend_class(name).is_available()
    with pytest.raises(sw.errors.BackendError) as e:
        sw.init_backend(name)
    assert "no NeuronCore" in str(e.value) and "gloo" in str(e.value) and repr(name) in str(e.value)
    assert not isinstance(e.value, sw.errors.BackendUnavailableError)
    assert current_backend() is None
    if native:
        assert _imported() == []  # refused before importing TorchNeuron
    # NeuronCores belong to the neuron backends: xla does not claim PJRT_DEVICE=NEURON either
    assert not backends.get_backend_class("xla").is_available()
    assert backends.resolve_auto() == "gloo"


@pytest.mark.parametrize("installed,asked,names", [
    (NEURON_XLA, "neuron", "neuron_xla"),   # torch-neuronx 2.9 installed: its backend is neuron_xla
    (NEURON_NATIVE, "neuron_xla", "'neuron'"),  # TorchNeuron installed: its backend is neuron
])
def test_the_wrong_neuron_backend_names_the_right_one(neuron_host, monkeypatch, installed, asked, names):
    monkeypatch.syspath_prepend(XLA)
    monkeypatch.syspath_prepend(installed)
    neuron_host(0, 2)
    with pytest.raises(sw.errors.BackendUnavailableError) as e:
        sw.init_backend(asked)
    assert names in str(e.value) and "requirements.txt" in str(e.value)
    assert _imported() == []  # decided from the package metadata, nothing imported


def test_an_unreadable_core_count_counts_none(neuron_host, monkeypatch):
    neuron_host(0, 2)
    (neuron.NEURON_SYSFS / "neuron1").mkdir()  # a device without core_count
    assert neuron.neuron_core_count() == 2


@pytest.mark.parametrize("name", ["neuron", "neuron_xla"])
def test_pypi_placeholder_is_backend_unavailable_with_the_install_hint(neuron_host, monkeypatch, name):
    monkeypatch.syspath_prepend(NEURON_PLACEHOLDER)
    neuron_host(0, 2)
    assert not backends.get_backend_class(name).is_available()
    with pytest.raises(sw.errors.BackendUnavailableError) as e:
        sw.init_backend(name)
    msg = str(e.value)
    assert "torch_neuronx" in msg and "pip.repos.neuron.amazonaws.com" in msg
    assert f"backends/{name}/requirements.txt" in msg
    assert isinstance(e.value.__cause__, RuntimeError)  # the placeholder's own error, chained


def test_native_version_rule():
    assert [neuron.is_native(v) for v in ((2, 9), (2, 10), (2, 13), (2, 14), (3, 0))] == [
        False, True, True, True, True]
