"""Fake hardware packages for the default (CPU) suite: put one folder first on ``sys.path``.

``NEURON`` holds a fake ``torch_neuronx`` and a fake ``torch_xla`` with only what the neuron
path touches (a CPU "xla" device, a gloo "xla" process group); ``NEURON_PLACEHOLDER`` holds a
``torch_neuronx`` that raises on import, like the placeholder package of that name on PyPI.
"""

from pathlib import Path

NEURON = str(Path(__file__).parent / "neuron")
NEURON_PLACEHOLDER = str(Path(__file__).parent / "neuron_placeholder")
NEURON_SITE = str(Path(__file__).parent / "neuron_site")               # sitecustomize: FAKE_NEURON_SYSFS
