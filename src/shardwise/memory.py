"""Peak resident memory of this process above a starting level (Linux ``/proc``), for the
demo and the benchmarks.

``ru_maxrss`` only ever grows over a process's life, so it cannot measure a second phase.
Writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0) resets the kernel's high-water mark
``VmHWM`` to the current RSS, which then measures the phase exactly. Where that write is not
allowed, a thread samples ``VmRSS`` every few milliseconds instead (a lower bound).
Elsewhere than Linux every figure reads 0.
"""

from __future__ import annotations

import threading


def memory_status() -> dict[str, int]:
    """``VmRSS`` / ``VmHWM`` of this process in bytes; empty where /proc is missing."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    st = memory_status()
    # RSS counters are batched per CPU; tolerate a little slack between the two fields.
    return "VmHWM" in st and st["VmHWM"] <= st.get("VmRSS", 0) + (1 << 20)


class PeakMemory:
    """``with PeakMemory() as peak: ...`` then ``peak.bytes``: the highest RSS reached inside
    the block minus the RSS at entry (this process, all threads).

    >>> with PeakMemory() as peak:
    ...     block = bytearray(50 << 20)
    >>> peak.bytes >= 50 << 20 or peak.method == "none"
    True
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.baseline = 0
        self.bytes = 0
        self.method = "none"
        self._max = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        self._max = max(self._max, memory_status().get("VmRSS", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakMemory:
        exact = reset_high_water_mark()
        self.baseline = self._max = memory_status().get("VmRSS", 0)
        if exact:
            self.method = "VmHWM"
        elif self.baseline:
            self.method = "sampled"
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="shardwise-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._sample()
        peak = memory_status().get("VmHWM", 0) if self.method == "VmHWM" else 0
        self.bytes = max(0, max(peak, self._max) - self.baseline)


__all__ = ["PeakMemory", "memory_status", "reset_high_water_mark"]
