"""One progress display for every path that moves bytes (load, save): a tqdm bar on the
rank that reports (tqdm is a dependency), or one line per file where an environment removed it."""

from __future__ import annotations

import sys


class Progress:
    """Bytes done, shown when ``active`` and (``progress`` is True, or None and stderr is a tty).

    >>> with Progress(100, progress=False, active=True, desc="shardwise load") as bar:
    ...     bar(100)
    """

    def __init__(self, total: int, progress: bool | None, active: bool, desc: str):
        self._bar, self._lines, self._desc = None, False, desc
        if not active or progress is False or (progress is None and not sys.stderr.isatty()):
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._lines = True
            return
        self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)

    def __enter__(self) -> Progress:
        return self

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def file(self, name: str) -> None:
        """Say that ``name`` is being worked on (only where there is no bar)."""
        if self._lines:
            print(f"{self._desc}: {name}", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
