"""``sw.verify`` / ``shardwise verify PATH``: is a checkpoint whole and unchanged since it was
saved? One process, no model, memory bounded by one read buffer: the format reader checks the
structure, then every blob is streamed through its recorded checksum (or the format's own)."""

from __future__ import annotations

import os
import sys
from contextlib import closing
from dataclasses import dataclass, field

from shardwise.errors import CheckpointError, ShardwiseError, UsageError
from shardwise.io.check import JsonReport, print_safely, quantized, some, stored
from shardwise.io.check.against import AgainstReport, check_against, expectations
from shardwise.io.formats import format_of, get_format
from shardwise.io.info import ALGORITHM, INFO_FILE, read_info
from shardwise.io.source import Stored
from shardwise.io.storage import Location, locate
from shardwise.io.storage.faults import StoreAccessError

UNVERIFIED_STATUS = 3
UNREADABLE_STATUS = 4


@dataclass
class VerifyReport(JsonReport):
    """What :func:`verify` found: ``problems`` (structural faults) and ``mismatched`` tensors make it
    not ``ok``; ``outcome`` is ``"OK"`` (every chunk checksummed), ``"UNVERIFIED"`` (structure
    only), ``"FAILED"`` or ``"UNREADABLE"`` (nothing could be read: no such path, or the storage
    refused or did not answer; ``unreadable`` says why, and nothing is known of the checkpoint);
    ``notes`` are not faults."""

    FLAGS = ("ok", "verified", "outcome")

    path: str
    kind: str = "unknown"
    tensors: int = 0
    chunks: int = 0
    checksummed: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    against: AgainstReport | None = None  # with verify(against=...): the comparison, also in problems
    unreadable: str = ""  # why nothing could be read (then outcome is UNREADABLE)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.mismatched and not self.unreadable

    @property
    def verified(self) -> bool:
        return self.ok and self.chunks > 0 and self.checksummed == self.chunks

    @property
    def outcome(self) -> str:
        if self.unreadable:
            return "UNREADABLE"
        return "FAILED" if not self.ok else "OK" if self.verified else "UNVERIFIED"

    def summary(self) -> str:
        """One line: the outcome and the counts."""
        counts = (f"{self.tensors} tensors in {self.chunks} chunks, {self.checksummed} checksummed, "
                  f"{self.bytes_read} bytes read")
        if self.against is not None:
            counts += f"; {self.against.summary()}"
        if self.outcome == "UNREADABLE":
            return f"UNREADABLE {self.path}: {self.unreadable}"
        if self.outcome == "OK":
            return f"OK {self.path}: {self.kind}, {counts}"
        if self.outcome == "UNVERIFIED":
            why = self.notes[0] if self.notes else "no checksum covers every chunk"
            return f"UNVERIFIED {self.path}: {self.kind}, {counts}: {why}"
        faults = []
        if self.mismatched:
            faults.append(f"{len(self.mismatched)} chunks differ from their checksum "
                          f"({some(self.mismatched, str)})")
        if self.problems:
            faults.append(f"{len(self.problems)} problem(s)")
        return f"FAILED {self.path}: {self.kind}, {'; '.join(faults)}; {counts}"


def verify(path: str | os.PathLike, *, against=None, dtype=None, layout: str = "auto",
           storage_options: dict | None = None) -> VerifyReport:
    """Check the checkpoint at ``path`` (safetensors file, index or folder, or DCP folder)
    without loading it: its structure, and every tensor against its recorded checksum.

    ``against``: a model (meta is enough), a model folder or its ``config.json``; then every
    tensor's name and shape (and dtype, for a model in hand or with ``dtype``) must be what the
    model holds in ``layout`` ("hub": as ``save_pretrained`` writes; "module": the model's own
    names; "auto": the one the names match); ``report.against`` lists the faults.

    Never raises for a bad checkpoint: the faults are in the report. A bad ``against`` raises
    before anything is read. ``storage_options`` go to the storage of a URL ``path``.

    >>> report = sw.verify("out/full")                     # doctest: +SKIP
    >>> report.ok, report.summary()                        # doctest: +SKIP
    (True, 'OK out/full: safetensors, 291 tensors in 291 chunks, 291 checksummed, 4021813248 bytes read')
    """
    if against is None and (dtype is not None or layout != "auto"):
        raise UsageError("dtype and layout say how to compare with a model: pass against= too")
    candidates = expectations(against, dtype=dtype) if against is not None else None
    where = locate(path, storage_options)
    report = VerifyReport(str(path))  # the user's spelling
    found, prefer = None, "module"
    try:
        if not where.exists():
            raise StoreAccessError(f"{path}: no such checkpoint file or folder")
        plugin = format_of(where)  # the kind is known even where opening then fails
        report.kind = plugin.CAPABILITIES.label or plugin.NAME
        prefer = plugin.CAPABILITIES.names  # the names its checkpoints most often hold
        with closing(plugin.open_source(where)) as source:  # headers, index, chunk tiling: raises on a fault
            found = _verify_source(source, report)
    except StoreAccessError as e:  # nothing read: not a verdict on the checkpoint
        report.unreadable = str(e)
    except CheckpointError as e:
        report.problems.append(str(e))
    except OSError as e:
        report.problems.append(f"{path}: cannot read the checkpoint: {e}")
    if found is not None:
        _check_quantized(where, found, report)
    if candidates is not None and found is not None:
        report.against = check_against(found, candidates, layout=layout, prefer=prefer)
        report.problems += report.against.problems()
    elif candidates is not None:
        report.notes.append("the checkpoint could not be read, so it was not compared with the model")
    return report


def _check_quantized(path: Location, found: dict[str, tuple[str, tuple]], report: VerifyReport) -> None:
    """Every quantized weight has its scales, of the shape its block size needs."""
    qc, pairs, problems = quantized(path, found)
    report.problems += problems
    unknown = [p.values for p in pairs.values() if p.block is None]
    if unknown and qc.has_file:
        report.problems.append(f"{qc.where}: no quantization_config with a weight_block_size, "
                               f"but {unknown[0]!r} (and {len(unknown) - 1} more) is FP8 with block scales; "
                               "a loader would read it as unquantized: write the checkpoint's "
                               "quantization_config into config.json")
    elif unknown:
        report.notes.append(f"{len(unknown)} FP8 weight(s) with scales but no config.json beside them: "
                            "the scales' shapes were not checked against a block size")


def _verify_source(source: Stored, report: VerifyReport) -> dict[str, tuple[str, tuple]]:
    """Every blob of ``source`` (a whole tensor, or a chunk) against the checksum recorded for
    it in ``shardwise.json``, else against the format's own (DCP's zip CRC-32); every recorded
    dtype and shape against the stored one; every recorded checksum whose blob is gone is a
    problem. Returns ``{name: (safetensors dtype, shape)}`` of the stored tensors."""
    found = stored(source)
    report.problems += source.describe().problems
    info = read_info(source.root)
    if info is None:
        otherwise = get_format(source.name).CAPABILITIES.own_checksums or (
            "the structure was checked, the values cannot be")
        report.notes.append(f"no {INFO_FILE}: no checksums recorded (not written by shardwise); {otherwise}")
    for name, saved in ((info or {}).get("tensors") or {}).items():
        if name in found and (saved["dtype"], tuple(saved["shape"])) != found[name]:
            dtype, shape = found[name]
            report.problems.append(f"tensor {name!r} is {dtype} {shape} in the checkpoint but was saved "
                                   f"as {saved['dtype']} {tuple(saved['shape'])}")
    sums = (info or {}).get("checksums") or {}
    algorithm, chunked = sums.get("algorithm", ALGORITHM), sums.get("chunks") or {}
    recorded: dict[tuple[str, str | None], str] = {}  # (tensor, chunk key or None) -> recorded sum
    recorded.update({(n, None): s for n, s in (sums.get("tensors") or {}).items()})
    recorded.update({(n, key): s for n, chunks in chunked.items() for key, s in chunks.items()})
    report.tensors = len(found)
    seen: set[tuple[str, str | None]] = set()
    for blob in source.blobs():
        report.chunks += 1
        seen.add((blob.tensor, blob.key))
        want = recorded.get((blob.tensor, blob.key))
        if want is None and not blob.own:
            continue
        try:
            got, own = blob.digest(algorithm if want is not None else "crc32")
        except CheckpointError as e:  # a bad blob: name it and go on with the others
            report.problems.append(f"tensor {blob.tensor!r} chunk at ({blob.key}): {e}")
            continue
        report.bytes_read += blob.nbytes
        want = want if want is not None else own
        report.checksummed += want is not None
        if want is not None and got != want:
            report.mismatched.append(blob.tensor if blob.key is None else f"{blob.tensor}@{blob.key}")
    gone = [n for n, key in recorded if key is None and n not in found]
    if gone:
        report.problems.append(f"{source.root}: {len(gone)} tensor(s) with a recorded checksum are missing "
                               f"from the checkpoint: {some(gone)}")
    gone = [f"{n}@{key}" for n, key in recorded if key is not None and (n, key) not in seen]
    if gone:
        report.problems.append(f"{source.root}: {len(gone)} chunk(s) with a recorded checksum are not in the "
                               f"checkpoint: {some(gone, str)}")
    if recorded and report.checksummed < report.chunks:
        report.notes.append(f"{report.chunks - report.checksummed} tensor(s) have no recorded checksum"
                            if sums.get("tensors") else "some chunks have no recorded checksum")
    return found


def main_verify(path: str, *, as_json: bool = False, against: str | None = None, dtype: str | None = None,
                layout: str = "auto", storage_options: dict | None = None) -> int:
    """``shardwise verify PATH [--against MODEL] [--json]``: the faults, then one summary line;
    0 when OK, 1 when FAILED, 3 when UNVERIFIED (no fault, but not every chunk has a checksum),
    4 when UNREADABLE (no such path, or the storage refused or did not answer), 2 when the model
    to compare with cannot be built."""
    try:
        report = verify(path, against=against, dtype=dtype, layout=layout, storage_options=storage_options)
    except ShardwiseError as e:
        print_safely(f"shardwise verify: --against {against}: {e}", file=sys.stderr)
        return 2
    if as_json:
        print_safely(report.to_json())
    else:
        for line in report.problems + [f"checksum differs: {m}" for m in report.mismatched]:
            print_safely(f"  {line}", file=sys.stderr)
        for line in report.notes:
            print_safely(f"  note: {line}", file=sys.stderr)
        print_safely(report.summary())
    return {"OK": 0, "FAILED": 1, "UNREADABLE": UNREADABLE_STATUS}.get(report.outcome, UNVERIFIED_STATUS)


__all__ = ["UNREADABLE_STATUS", "UNVERIFIED_STATUS", "VerifyReport", "main_verify", "verify"]
