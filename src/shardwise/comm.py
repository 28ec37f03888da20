"""Every collective shardwise runs, bounded by the ``backend=`` timeout (resolved once by a public
entry; None: a world of one) and failing as a ``CollectiveError`` naming the operation, group
size and rank. :func:`agree` is the cross-rank verdict: if any rank failed, every rank raises."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from shardwise.backends import Backend
from shardwise.backends.base import Pending, guarded, reduce_op_of
from shardwise.errors import BackendError, CheckpointError, CollectiveError, ShardwiseError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _device_types(group=None) -> set[str]:
    """The device types ``group`` (None: the default) has a backend for; empty where torch cannot
    say (a process group written in Python, such as torch_xla's)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return {d.type for d in pg._device_types}
    except (AttributeError, RuntimeError):  # not a c10d ProcessGroup, or one without backends
        return set()


class AdoptedBackend(Backend):
    """Collectives over a process group that shardwise did not start (no ``init_backend``)."""

    name = "adopted"

    def __init__(self):
        super().__init__()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def _device(self) -> torch.device:
        types = _device_types()
        if "cpu" in types:
            return torch.device("cpu")
        if "cuda" in types:
            return torch.device("cuda", torch.cuda.current_device())
        raise BackendError(
            f"shardwise cannot tell which device the tensors of this process's group "
            f"({dist.get_backend()!r}) must be on: call sw.init_backend() with its backend's name "
            "before loading or saving"
        )


def device_for(group=None, *, backend: Backend | None) -> torch.device:
    """The device of the tensors ``group``'s collectives move (None: the default group): the CPU
    where it takes host tensors (gloo) or without a backend, else ``backend``'s device (a
    device-only group refuses CPU tensors, or, torch_xla's, ignores them).

    >>> device_for(backend=None)   # one process
    device(type='cpu')
    """
    if backend is None or "cpu" in _device_types(group):
        return torch.device("cpu")
    return torch.device(backend.device)


def all_reduce(tensor: torch.Tensor, op: str = "sum", *, backend: Backend | None, group=None,
               purpose: str = "") -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (``op``: sum, max, min, product) and return it;
    every rank of the group calls it. ``purpose`` says what for, in the error.

    >>> all_reduce(torch.ones(1), "max", backend=None)   # one process
    tensor([1.])
    """
    if backend is None:
        reduce_op_of(op)  # an unknown op is refused in a world of one too
        return tensor
    return backend.all_reduce(tensor, op, group=group, purpose=purpose)


def broadcast(tensor: torch.Tensor, src: int, *, backend: Backend | None, group=None, purpose: str = "",
              async_op: bool = False) -> Pending:
    """Overwrite ``tensor`` on every rank of ``group`` with global rank ``src``'s; returns a
    :class:`Pending` (already finished unless ``async_op``)."""
    if backend is None:
        return Pending(None, "broadcast", None)
    pending = backend.issue("broadcast", partial(dist.broadcast, tensor, src=src, group=group, async_op=True),
                            group=group, purpose=purpose)
    if not async_op:
        pending.wait()
    return pending


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_sizes: list[int],
                      input_sizes: list[int], *, backend: Backend | None, group=None,
                      purpose: str = "") -> torch.Tensor:
    """Send ``input_sizes[r]`` elements of ``tensor`` to each group rank ``r`` and receive
    ``output_sizes[r]`` from each into ``output``; every rank of the group calls it."""
    if backend is None:
        return output.copy_(tensor)
    backend.issue("all_to_all_single", partial(dist.all_to_all_single, output, tensor, output_sizes,
                                               input_sizes, group=group, async_op=True),
                  group=group, purpose=purpose).wait()
    return output


def all_reduce_inline(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group``, synchronously (local holding's forward and
    backward: every step), bounded by the process group's own timeout."""
    with guarded("all_reduce", group=group):
        dist.all_reduce(tensor, group=group)
    return tensor


def all_gather_inline(parts: list[torch.Tensor], tensor: torch.Tensor, *, group=None) -> list[torch.Tensor]:
    """Every group rank's ``tensor`` into ``parts``, as :func:`all_reduce_inline`."""
    with guarded("all_gather", group=group):
        dist.all_gather(parts, tensor, group=group)
    return parts


def broadcast_object(obj, src: int = 0, *, group=None, purpose: str = ""):
    """Global rank ``src``'s ``obj`` (picklable) on every rank of ``group``."""
    if world_size() == 1:
        return obj
    box = [obj]
    with guarded("broadcast_object_list", group=group, purpose=purpose):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj, *, group=None, purpose: str = "") -> list:
    """Every rank's ``obj`` (picklable), in group-rank order, on every rank of ``group``."""
    if world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    with guarded("all_gather_object", group=group, purpose=purpose):
        dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj, dst: int = 0, *, group=None, purpose: str = "") -> list | None:
    """Every rank's ``obj`` (picklable), in group-rank order, on global rank ``dst`` (else None)."""
    if world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size(group) if rank() == dst else None
    with guarded("gather_object", group=group, purpose=purpose):
        dist.gather_object(obj, out, dst=dst, group=group)
    return out


# --- the cross-rank verdict ------------------------------------------------------------------

# A verdict row: status (1 byte), plan fingerprint (8 bytes), then the error text.
_MSG_BYTES = 1015
_ROW_BYTES = 1 + 8 + _MSG_BYTES
_OK, _BAD_INPUT, _FAILED = 0, 1, 2


def fingerprint(parts) -> bytes:
    """8 bytes that differ when two ranks would save different tensors or files."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()


def capture(fn: Callable[[], object]) -> Exception | None:
    """Run ``fn``; return its exception (to hand to :func:`agree`) or None."""
    try:
        fn()
    except Exception as e:  # reported to every rank by agree(), re-raised there
        return e
    return None


def _row(error: BaseException | None, digest: bytes) -> torch.Tensor:
    row = torch.zeros(_ROW_BYTES, dtype=torch.uint8)
    status = _OK if error is None else _BAD_INPUT if isinstance(error, ValueError) else _FAILED
    row[0] = status
    row[1:9] = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:_MSG_BYTES]
        row[9 : 9 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return row


def _said_once(failures: dict[int, str], world: int) -> bool:
    """Whether rank 0 can report ``failures`` for every rank (``backends.report_once``): it alone
    failed (it did the work for all, or its failure stopped the others), or every rank failed
    with the same message; and its error is shardwise's (the hook reports only those)."""
    if 0 not in failures or not (set(failures) == {0} or (len(failures) == world
                                                          and len(set(failures.values())) == 1)):
        return False
    name = failures[0].partition(":")[0]
    ours, todo = set(), [ShardwiseError]
    while todo:
        cls = todo.pop()
        ours.add(cls.__name__)
        todo += cls.__subclasses__()
    return name in ours


def agree(backend: Backend | None, error: BaseException | None, *, what: str,
          digest: bytes = b"\0" * 8) -> None:
    """Every rank calls it at the same point; if any rank failed, every rank raises: the failed
    rank its own ``error``, the others ``CheckpointError`` (bad input, a ``ValueError``) or
    ``CollectiveError`` (anything else) with each failing rank's message. A ``digest`` (a
    :func:`fingerprint`) that differs from rank 0's raises ``CheckpointError`` everywhere. When
    rank 0 alone failed, or every rank alike, the errors are marked for one report, by rank 0
    (``errors.on_every_rank``)."""
    if backend is None or backend.world_size == 1:
        if error is not None:
            raise error
        return
    try:
        rows = backend.all_gather(_row(error, digest).to(backend.device))
    except CollectiveError:
        if error is not None:  # our own failure says more than a peer's absence
            raise error from None
        raise
    rows = [r.cpu() for r in rows]
    failures = {r: bytes(row[9:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
                for r, row in enumerate(rows) if int(row[0]) != _OK}
    once = _said_once(failures, len(rows))
    if error is not None:
        if once and isinstance(error, ShardwiseError):
            error.every_rank = True  # type: ignore[attr-defined]
        raise error
    if failures:
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        if all(int(rows[r][0]) == _BAD_INPUT for r in failures):
            peer: ShardwiseError = CheckpointError(f"{what} failed on rank(s) {sorted(failures)}: {detail}")
        else:
            peer = CollectiveError(f"{what} failed on rank(s) {sorted(failures)}", failures)
        if once:  # rank 0's failure, which it reports: this rank's error echoes it
            peer.every_rank, peer.echo = True, failures[0]  # type: ignore[attr-defined]
        raise peer
    differ = [r for r, row in enumerate(rows) if bytes(row[1:9].tolist()) != bytes(rows[0][1:9].tolist())]
    if differ:
        raise CheckpointError(
            f"{what}: rank(s) {differ} hold different tensors (names, dtypes, shapes or shard "
            "specs) than rank 0; every rank must call sw.save on the same model, parallelised "
            "with the same plan"
        )


__all__ = [
    "AdoptedBackend", "Pending", "agree", "all_gather_inline", "all_gather_object", "all_reduce",
    "all_to_all_single", "all_reduce_inline", "broadcast", "broadcast_object", "capture", "device_for",
    "fingerprint", "gather_object", "guarded", "is_distributed", "rank", "world_size",
]
