"""Checking checkpoints without a model: ``verify`` (whole and unchanged), ``diff`` (two
checkpoints tensor by tensor, any layouts) and ``inspect`` (what a checkpoint is)."""
