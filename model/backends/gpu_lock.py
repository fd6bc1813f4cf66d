"""One forward at a time on a GPU, across processes: a per-GPU file lock held while a forward's work is queued.

Scorer processes that share a GPU (configs/prod.yaml runs three per GPU) time-slice it: the driver preempts one
context's running kernels to run another's. Under that preemption a fast-path forward has hung for good
(BENCHMARKS.md, "Scorers sharing a GPU"); one process alone never has. Holding this lock from a forward's launch
until its GPU work is done means only one context on the GPU ever has work queued, so the driver switches
contexts only between forwards and never preempts a kernel mid-flight. Processes still prepare their next batch
on the CPU while another's forward runs. The lock is an `flock` on a file named by the GPU's UUID (every process
on the node sees the same GPU under the same UUID, whatever CUDA_VISIBLE_DEVICES it has), released by the
kernel when its process dies, so a replica that is killed never leaves the GPU locked.

A polled forward (`launch`) hands its release to `release_after`: a thread of the lock's own waits on the
forward's last CUDA event and unlocks at once, so the next process's forward does not wait for the launching
thread's event loop to come round to collecting.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import tempfile
import threading
import time

log = logging.getLogger(__name__)


def lock_dir() -> str:
    """Where the lock files live: /dev/shm (shared by every process of a node or pod) when writable, else the
    temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class GpuLock:
    """An exclusive, re-entrant (by count) lock on one GPU shared by every process that opens the same path.

    Callers that take it serialise on their own lock first (the fast forward's engine lock); the count itself is
    guarded, so a level handed to `release_after` may be given back from its thread while the caller goes on."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._count = 0
        self._mutex = threading.Lock()
        self._after: queue.SimpleQueue | None = None   # (event, released) pairs for the release thread
        self.held_since: float | None = None   # time.monotonic() when this process took the lock; None if not held
        self.waits = 0                         # acquisitions that found another process holding it
        self.wait_s = 0.0                      # seconds spent waiting for it
        self.acquisitions = 0                  # times this process took it (outermost level)
        self.held_s = 0.0                      # seconds this process held it, released holds only

    def _open(self) -> int:
        if self._fd is None:
            # read-only is enough for flock, so a lock file another user created (mode 0644) still opens
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o666)
        return self._fd

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock (or one more level of it); False when `blocking` is off and another process holds it, or
        (never waiting) while a thread of this process waits for it."""
        if not self._mutex.acquire(blocking):   # a blocking waiter holds the mutex: an event loop must not wait
            return False
        try:   # at count 0 no release is pending, so waiting here holds up no other thread
            return self._acquire(blocking)
        finally:
            self._mutex.release()

    def _acquire(self, blocking: bool) -> bool:
        if self._count:
            self._count += 1
            return True
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                return False
            t = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)   # releases the GIL while it waits
            self.waits += 1
            self.wait_s += time.monotonic() - t
        self._count = 1
        self.acquisitions += 1
        self.held_since = time.monotonic()
        return True

    def release(self) -> None:
        """Give back one level; the last one unlocks the file."""
        with self._mutex:
            if not self._count:
                raise RuntimeError("GpuLock.release() without a matching acquire()")
            self._count -= 1
            if not self._count:
                if self.held_since is not None:
                    self.held_s += time.monotonic() - self.held_since
                self.held_since = None
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def release_after(self, done) -> threading.Event:
        """Give back one level once the GPU has reached `done` (a torch.cuda.Event; None: now), from this lock's
        release thread; returns a threading.Event set when it is given back. Levels handed over are released in
        the order they were handed over."""
        released = threading.Event()
        with self._mutex:
            if self._after is None:
                self._after = queue.SimpleQueue()
                threading.Thread(target=self._release_loop, args=(self._after,), name="gpu-lock-release",
                                 daemon=True).start()
        self._after.put((done, released))
        return released

    def _release_loop(self, after: queue.SimpleQueue) -> None:
        while True:
            done, released = after.get()
            try:
                if done is not None:
                    done.synchronize()   # spins without the GIL; a CUDA error surfaces again at the collect
            except Exception:  # noqa: BLE001 - the lock goes back whatever the GPU did
                log.debug("GPU work before a lock release failed", exc_info=True)
            try:
                self.release()
            except Exception:  # noqa: BLE001 - closed meanwhile (the file, and so the lock, is gone) or unlock failed
                log.warning("GPU lock %s: a handed-over release failed", self.path, exc_info=True)
            finally:
                released.set()   # the collect waiting on it must never hang on this thread's failure

    @property
    def held(self) -> bool:
        """Whether this process holds the lock."""
        return self._count > 0

    def __enter__(self) -> GpuLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def close(self) -> None:
        """Close the file (unlocking it if held)."""
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._count, self.held_since = None, 0, None


def for_device(device) -> GpuLock | None:
    """The lock of the CUDA device `device` (a torch.device), or None for a CPU device or a GPU whose UUID torch
    does not report (then nothing is serialised, and that is logged)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
    if uuid is None:
        log.warning("GPU %d reports no UUID: forwards of processes sharing it are not serialised", idx)
        return None
    return GpuLock(os.path.join(lock_dir(), "laya-fleet-gpu-%s.lock" % str(uuid).replace("/", "_")))


__all__ = ["GpuLock", "for_device", "lock_dir"]
