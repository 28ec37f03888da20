"""Stands in for the torch-neuronx package on PyPI, a placeholder that raises on import."""

raise RuntimeError("torch-neuronx is not distributed on PyPI; install it from the AWS Neuron "
                   "package repository (pip.repos.neuron.amazonaws.com)")
