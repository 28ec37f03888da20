"""The backend registry: ``init_backend(name)`` gives every path one device, mesh and collective
interface. Third parties add backends with ``register_backend`` or the ``shardwise.backends``
entry-point group (a factory taking ``timeout=``). A built-in module is imported on first lookup."""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from shardwise.backends.base import MESH_AXES, Backend
from shardwise.backends.launch import torchrun_env
from shardwise.errors import BackendError, ShardwiseError, UnknownBackendError, UsageError

ENTRY_POINT_GROUP = "shardwise.backends"
# "auto" asks these, in order, whether they are available (xla_spmd: only where SPMD is on)
AUTO_ORDER = ("neuron", "neuron_xla", "xla_spmd", "xla", "nccl", "gloo")
BUILTINS = {
    "gloo": "shardwise.backends.base:GlooBackend",
    "nccl": "shardwise.backends.nccl:NcclBackend",
    "xla": "shardwise.backends.xla:XlaBackend",
    "xla_spmd": "shardwise.backends.xla_spmd:XlaSpmdBackend",
    "neuron": "shardwise.backends.neuron:NeuronBackend",
    "neuron_xla": "shardwise.backends.neuron:NeuronXlaBackend",
}

Factory = Callable[..., Backend]
_registry: dict[str, Factory] = {}
_entry_points_loaded = False
_active: Backend | None = None
_lock = threading.Lock()


def register_backend(name: str, factory: Factory) -> None:
    """Register ``factory`` (a Backend subclass or callable taking ``timeout=``) as ``name``.

    >>> register_backend("mygloo", GlooBackend)   # doctest: +SKIP
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise UsageError(f"backend name must be a non-empty string other than 'auto', got {name!r}")
    if name in _registry or name in BUILTINS:
        raise UsageError(f"backend {name!r} is already registered (known: {', '.join(_known())})")
    _registry[name] = factory


def _known() -> list[str]:
    return sorted(set(_registry) | set(BUILTINS))


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry or ep.name in BUILTINS:
            continue
        try:
            register_backend(ep.name, ep.load())
        except Exception as e:  # a broken plugin must not break the built-in backends
            import warnings

            warnings.warn(f"shardwise: could not load backend entry point {ep.name!r}: {e}", stacklevel=2)


def available_backends() -> list[str]:
    """Every registered backend name (built-in and entry points)."""
    _load_entry_points()
    return _known()


def get_backend_class(name: str) -> Factory:
    if name in BUILTINS:
        module, cls = BUILTINS[name].split(":")
        return getattr(importlib.import_module(module), cls)
    _load_entry_points()
    try:
        return _registry[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown backend {name!r}; known backends: {', '.join(_known())} (or 'auto')"
        ) from None


def resolve_auto() -> str:
    """The first backend of ``AUTO_ORDER`` available here."""
    for name in AUTO_ORDER:
        factory = get_backend_class(name)
        is_available = getattr(factory, "is_available", None)
        if is_available is None or is_available():
            return name
    return "gloo"


def init_backend(name: str = "auto", *, timeout=None) -> Backend:
    """Start the backend ``name`` in this process (idempotent; a different name raises) and return
    it; without a torchrun environment the world is this process. ``timeout`` (seconds or a
    timedelta; default 10 minutes) bounds joining the group and every collective on it.

    >>> import shardwise as sw
    >>> backend = sw.init_backend("gloo")   # doctest: +SKIP
    >>> backend.world_size                  # doctest: +SKIP
    1"""
    global _active
    with _lock:
        wanted = resolve_auto() if name == "auto" else name
        if _active is not None:
            if name != "auto" and _active.name != wanted:
                raise BackendError(
                    f"backend {_active.name!r} is already initialised in this process; "
                    f"cannot switch to {name!r} (call shutdown_backend() first)"
                )
            return _active
        backend = get_backend_class(wanted)(timeout=timeout)
        backend.start()
        install_excepthook()  # a guard's error, raised alike on every rank, reported once
        _active = backend
        return backend


def current_backend() -> Backend | None:
    """The backend ``init_backend`` started in this process, or None."""
    return _active


def coordination_group(backend: Backend | None):
    """``backend.coordination_group``, None (the default group) without a backend."""
    return backend.coordination_group if backend is not None else None


def shutdown_backend() -> None:
    """Shut the active backend down, so that ``init_backend`` can start another."""
    global _active
    with _lock:
        if _active is not None:
            _active.shutdown()
        _active = None


# -- one report of an error every rank raised alike ------------------------------------------
WAIT_SECONDS = 60.0
_KEY = "shardwise/every_rank_error"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_installed = False


def install_excepthook() -> None:
    """Chain a ``sys.excepthook`` (once per process) that reports an error marked by
    ``shardwise.errors.on_every_rank`` once (:func:`report_once`); others go to the previous hook."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind, error, tb):
        if not (isinstance(error, ShardwiseError) and getattr(error, "every_rank", False)
                and dist.is_initialized() and dist.get_world_size() > 1):
            previous(kind, error, tb)
            return
        try:
            report_once(error, tb)
        except Exception:  # noqa: BLE001 - a broken report must not hide the error itself
            previous(kind, error, tb)

    sys.excepthook = hook
    _installed = True


def _where(tb) -> str:
    """The innermost frame outside the shardwise package: the user's call."""
    frames = [f for f in traceback.extract_tb(tb) if not os.path.abspath(f.filename).startswith(_PACKAGE)]
    if not frames:
        return ""
    f = frames[-1]
    return f"  at {f.filename}, line {f.lineno}: {(f.line or '').strip()}"


def report_once(error: ShardwiseError, tb) -> None:
    """Print ``error`` once for the world: rank 0 prints it and puts it in the store; a rank with
    another message (or no word within ``WAIT_SECONDS``) prints its own. Under torchrun every
    rank also writes the error file torchrun reads (as ``@record`` does)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    message = f"{type(error).__name__}: {error}"
    lines = [message, f"  (from a check all {world} ranks run alike, before any collective: "
                      "reported once, by rank 0)", _where(tb)]
    text = "\n".join(line for line in lines if line)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        _error_file(message, text)
        store.set(_KEY, message)
        # a launcher stops the other ranks once rank 0 exits: first let each one decide (and
        # print its own report if its error differs)
        _rank0_said(store, key=_KEY + "/all read")
        return
    said, echo = _rank0_said(store), getattr(error, "echo", None)  # echo: rank 0's, by comm.agree
    same = said is not None and (said == message
                                 or (echo is not None and said.startswith(echo.rstrip("\ufffd"))))
    if same:
        _error_file(message, f"the same {type(error).__name__} as rank 0 (reported there)" if echo is None
                    else "rank 0's error (reported there)")
    else:
        sys.stderr.write("\n".join(f"[rank{rank}]: {line}" for line in [message, _where(tb)] if line)
                         + "\n")
        sys.stderr.flush()
        _error_file(message, message)
    try:
        if store.add(_KEY + "/read", 1) == world - 1:
            store.set(_KEY + "/all read", "1")
    except Exception:  # noqa: BLE001 - rank 0 then waits its bounded time
        pass
    if same and os.environ.get("TORCHELASTIC_RUN_ID"):
        # torchrun stops this rank once rank 0 has exited: rank 0 is then the first failure
        # of its summary, with its exit status, not a rank stopped before it finished
        _rank0_said(store, key=_KEY + "/never set")


def _rank0_said(store, key: str = _KEY) -> str | None:
    try:
        store.wait([key], timedelta(seconds=WAIT_SECONDS))
        return store.get(key).decode()
    except Exception:  # noqa: BLE001 - no word from rank 0: this rank reports for itself
        return None


def _error_file(message: str, shown: str) -> None:
    # torchrun's summary shows ``py_callstack`` of each failed rank; its first failure is the
    # earliest timestamp, rank 0's (the others write theirs after reading rank 0's message)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # torchrun then shows its own line; the report above is on stderr already


__all__ = [
    "AUTO_ORDER", "BUILTINS", "Backend", "ENTRY_POINT_GROUP", "MESH_AXES", "available_backends",
    "coordination_group", "current_backend", "get_backend_class", "init_backend", "install_excepthook",
    "register_backend", "resolve_auto", "shutdown_backend", "torchrun_env",
]
