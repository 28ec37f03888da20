"""A fake torch_neuronx for the CPU suite: importable, nothing more.

The real package registers the Neuron PJRT plugin (PJRT_DEVICE=NEURON); the tests set that
variable themselves, and whether a NeuronCore exists is said by a fake Neuron sysfs tree
(``shardwise.backends.neuron.NEURON_SYSFS``), as the Neuron driver says it on a real host.
"""

FAKE = True
