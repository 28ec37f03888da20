"""Coordination around torch.distributed.checkpoint: its failures as ShardwiseErrors, and
the chunk checksums of a distributed save gathered to rank 0.

DCP reports a failure as ``CheckpointException`` (a BaseException carrying every rank's
exception) and lets a collective whose peer died raise gloo's or NCCL's ``RuntimeError``;
:func:`dcp_error` turns both into errors from ``shardwise.errors`` that name the checkpoint
and every rank's fault (shardwise's own collectives get theirs from ``shardwise.comm``).
"""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: name it

import shardwise.comm as comm
from shardwise.backends import coordination_group
from shardwise.errors import CheckpointError, CollectiveError, ShardwiseError
from shardwise.io.dcp_items import HashingWriter
from shardwise.io.info import ALGORITHM


def gather_checksums(writer: HashingWriter, what: str) -> dict:
    """Every rank's chunk checksums (``shardwise.json``'s "checksums"), merged on rank 0;
    every rank calls it, after the data is written. Other ranks get an empty record."""
    everyone = comm.gather_object(writer.checksums, dst=0, group=coordination_group(), purpose=what)
    if everyone is None:  # not rank 0
        return {}
    sums: dict = {}
    for part in everyone:
        for fqn, chunks in part.items():
            sums.setdefault(fqn, {}).update(chunks)
    return {"algorithm": ALGORITHM, "chunks": sums}


def dcp_error(path, e: BaseException, what: str) -> ShardwiseError:
    """A ShardwiseError for a failure that ``dcp.save`` / ``dcp.load`` raised: every rank's
    message from a ``CheckpointException`` (a CheckpointError when each rank's failure was
    bad input, such as a corrupt file); a CollectiveError for a collective that failed."""
    if isinstance(e, ShardwiseError):
        return e
    if isinstance(e, CheckpointException):
        failures = {}
        for rank, wrapped in e.failures.items():
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            failures[rank] = f"{type(exc).__name__}: {exc}"
        bad_input = all(isinstance(w[0] if isinstance(w, tuple) else w, ValueError)
                        for w in e.failures.values())
        if bad_input:
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
            return CheckpointError(f"{path}: {what} failed: {detail}")
        return CollectiveError(f"{path}: {what} failed on rank(s) {sorted(failures)}", failures)
    return CollectiveError(f"{path}: {what} failed: a collective failed, so another rank stopped "
                           f"or died ({type(e).__name__}: {e})")


__all__ = ["dcp_error", "gather_checksums"]
