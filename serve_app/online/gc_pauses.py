"""Python's garbage collector in a serving replica: its collections and their pauses, for /stats.

A replica holds a few hundred thousand long-lived objects once torch, Ray, FastAPI, the tokenizers and the model
are loaded; a full (generation 2) collection walks all of them while holding the GIL, and every request of that
replica waits for it. Ray Serve 2.60 freezes them at the end of a replica's start-up
(`RAY_SERVE_FREEZE_GC_ON_STARTUP`, on by default: `gc.collect()` then `gc.freeze()`), so later collections walk
only what was made since; `frozen` in the snapshot shows that it happened, and the per-generation counts and
times show what collections still cost under load (bench/serve_load.py prints generation 2's per level).
"""

from __future__ import annotations

import gc
import os
import threading
import time


class GcWatch:
    """Collections and their time per generation in this process, from the moment `watch` hooks `gc.callbacks`."""

    def __init__(self):
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        # runs in whichever thread triggered the collection, with the GIL held for the whole of it
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g = info.get("generation", 2)
        took = time.perf_counter() - self._t0
        self.counts[g] += 1
        self.seconds[g] += took
        self.max_s[g] = max(self.max_s[g], took)

    def snapshot(self) -> dict:
        """{"collections": [gen0, gen1, gen2], "seconds": [...], "max_ms": [...], "frozen": objects frozen,
        "pid": this process}: `frozen` drops as frozen objects are freed, so the pid is what names the process."""
        return {"collections": list(self.counts), "seconds": [round(s, 6) for s in self.seconds],
                "max_ms": [round(1000.0 * s, 3) for s in self.max_s], "frozen": gc.get_freeze_count(),
                "pid": os.getpid()}


_watch: GcWatch | None = None
_lock = threading.Lock()


def watch() -> GcWatch:
    """This process's one `GcWatch`, hooked on first use."""
    global _watch
    with _lock:
        if _watch is None:
            _watch = GcWatch()
            gc.callbacks.append(_watch._callback)
        return _watch
