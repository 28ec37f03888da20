"""Distributed checkpoints: torch DCP folders and sharded safetensors (every rank writes its own
regions), their metadata and chunk readers, optimizer state, and consolidation to safetensors."""
