"""CPU processes joined by gloo: the reference backend, and the one the tests run."""

from __future__ import annotations

from shardwise.backends.base import Backend


class GlooBackend(Backend):
    name = "gloo"
    dist_backend = "gloo"
    device_type = "cpu"
    supports_dtensor = True
    supports_gather = True
