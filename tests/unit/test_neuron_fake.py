"""The neuron backend's detection and error paths, against a fake torch_neuronx (and the fake
torch_xla it needs) in this process. No process group is started here; init, placement and
loads run on spawned ranks in tests/dist/test_neuron_fake_ranks.py."""

import sys

import pytest

import shardwise as sw
from fakes import NEURON, NEURON_PLACEHOLDER
from shardwise import backends
from shardwise.backends import neuron

_FAKED = ("torch_neuronx", "torch_xla")


def _drop_faked_modules():
    for name in [m for m in sys.modules if m.split(".")[0] in _FAKED]:
        del sys.modules[name]


@pytest.fixture
def neuron_host(tmp_path, monkeypatch):
    """A host as the neuron backend sees it: package folders first on sys.path, a sysfs tree;
    returns a function adding NeuronCores to that tree. Every faked module goes afterwards."""
    sw.shutdown_backend()
    monkeypatch.setattr(neuron, "NEURON_SYSFS", tmp_path / "neuron_device")
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")  # what importing the real torch_neuronx sets
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


def test_auto_picks_neuron_when_a_neuroncore_exists(neuron_host, monkeypatch):
    monkeypatch.syspath_prepend(NEURON)
    neuron_host(0, 2)
    neuron_host(1, 2)
    assert neuron.neuron_core_count() == 4
    assert backends.get_backend_class("neuron").is_available()
    assert backends.resolve_auto() == "neuron"


def test_no_neuroncore_means_not_available_and_a_clear_start_error(neuron_host, monkeypatch):
    monkeypatch.syspath_prepend(NEURON)
    assert neuron.neuron_core_count() == 0
    assert not backends.get_backend_class("neuron").is_available()
    # NeuronCores belong to the neuron backend: xla does not claim PJRT_DEVICE=NEURON either
    assert not backends.get_backend_class("xla").is_available()
    assert backends.resolve_auto() == "gloo"
    with pytest.raises(sw.BackendError) as e:
        sw.init_backend("neuron")
    assert "no NeuronCore" in str(e.value) and "gloo" in str(e.value)
    assert not isinstance(e.value, sw.BackendUnavailableError)
    assert sw.current_backend() is None


def test_an_unreadable_core_count_counts_none(neuron_host, monkeypatch):
    neuron_host(0, 2)
    (neuron.NEURON_SYSFS / "neuron1").mkdir()  # a device without core_count
    assert neuron.neuron_core_count() == 2


def test_pypi_placeholder_is_backend_unavailable_with_the_install_hint(neuron_host, monkeypatch):
    monkeypatch.syspath_prepend(NEURON_PLACEHOLDER)
    neuron_host(0, 2)
    assert not backends.get_backend_class("neuron").is_available()
    with pytest.raises(sw.BackendUnavailableError) as e:
        sw.init_backend("neuron")
    msg = str(e.value)
    assert "torch_neuronx" in msg and "pip.repos.neuron.amazonaws.com" in msg
    assert isinstance(e.value.__cause__, RuntimeError)  # the placeholder's own error, chained
