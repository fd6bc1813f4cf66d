"""The cross-process GPU lock (model/backends/gpu_lock.py) between real processes, and the fast forward holding it
from launch until its GPU work is done (CPU, torch ops, an explicit lock; on CUDA the device's UUID names it)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from model.backends.fast import make_backend
from model.backends.gpu_lock import GpuLock, for_device, lock_dir
from model.bundle import load_model

CTX = mp.get_context("spawn")


def _hold(path: str, held, release) -> None:
    """Child: take the lock, say so, hold it until told (or killed)."""
    lock = GpuLock(path)
    lock.acquire()
    held.set()
    release.wait(60)
    lock.release()


def _try(path: str, out) -> None:
    """Child: a non-blocking take; puts whether it got the lock."""
    lock = GpuLock(path)
    got = lock.acquire(blocking=False)
    out.put(got)
    if got:
        lock.release()


def _other_process_gets_it(path: str) -> bool:
    q = CTX.Queue()
    p = CTX.Process(target=_try, args=(path, q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    return got


@pytest.fixture
def holder(tmp_path):
    """A child process holding the lock at tmp_path/gpu.lock until `release` is set."""
    path = str(tmp_path / "gpu.lock")
    held, release = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_hold, args=(path, held, release))
    p.start()
    assert held.wait(60), "the holding process never took the lock"
    yield path, p, release
    if p.is_alive():   # (Event.set would wait forever on a waiter that was killed)
        release.set()
        p.join(60)
    if p.is_alive():
        p.kill()


def test_a_lock_held_by_another_process_is_refused_then_given_when_it_lets_go(holder):
    path, proc, release = holder
    mine = GpuLock(path)
    assert not mine.acquire(blocking=False) and not mine.held and mine.held_since is None
    release.set()
    proc.join(60)
    assert mine.acquire(blocking=False) and mine.held and mine.held_since is not None
    mine.release()
    assert not mine.held and mine.held_since is None


def test_a_blocking_acquire_waits_for_the_holder_and_counts_the_wait(holder):
    path, proc, release = holder
    mine = GpuLock(path)
    threading.Timer(0.3, release.set).start()   # the holder lets go while this process waits
    assert mine.acquire()
    assert mine.waits == 1 and mine.wait_s > 0 and mine.held
    mine.release()


def test_a_killed_holder_leaves_the_gpu_unlocked(holder):
    path, proc, _ = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    mine = GpuLock(path)
    assert mine.acquire(blocking=False)
    mine.release()


def test_the_lock_is_reentrant_by_count_and_a_stray_release_is_an_error(tmp_path):
    path = str(tmp_path / "gpu.lock")
    lock = GpuLock(path)
    with lock:
        assert lock.acquire(blocking=False)   # a second level
        lock.release()
        assert lock.held and not _other_process_gets_it(path)
    assert not lock.held and _other_process_gets_it(path)
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        lock.release()
    lock.close()


def test_a_cpu_device_has_no_gpu_lock_and_locks_live_in_shared_memory():
    assert for_device(torch.device("cpu")) is None
    assert os.path.isdir(lock_dir()) and os.access(lock_dir(), os.W_OK)


class _GpuWork:
    """Stands in for a CUDA event on the CPU machine: `synchronize` returns once `finish()` is called (the
    GPU's part of a forward, which this machine cannot run)."""

    def __init__(self):
        self._done = threading.Event()

    def finish(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        assert self._done.wait(60), "the GPU work never finished"


def test_a_handed_over_release_waits_for_the_gpu_work_then_unlocks_in_order(tmp_path):
    path = str(tmp_path / "gpu.lock")
    lock = GpuLock(path)
    first, second = _GpuWork(), _GpuWork()
    lock.acquire()
    lock.acquire()
    r1, r2 = lock.release_after(first), lock.release_after(second)
    assert not r1.wait(0.3) and lock.held and not _other_process_gets_it(path)
    second.finish()                      # released in order: nothing goes before the first level
    assert not r1.wait(0.3) and not r2.is_set() and lock.held
    first.finish()
    assert r1.wait(10) and r2.wait(10)
    assert not lock.held and lock.held_since is None and _other_process_gets_it(path)
    assert lock.acquire(blocking=False)   # the lock is whole again: a fresh level
    assert lock.release_after(None).wait(10) and not lock.held
    lock.close()


def test_the_fast_forward_holds_the_gpu_lock_until_its_work_is_done(bundle, rows, tmp_path):
    """A launched forward keeps other processes off the GPU until its GPU work is done (on CPU: done at launch,
    so the lock goes back before the collect), and its engine lock until it is collected; while another process
    holds the GPU, `launch` queues nothing (None) and `forward` waits for it, with the same answers."""
    path = str(tmp_path / "gpu.lock")
    lock = GpuLock(path)
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=2048,
                        gpu_lock=lock)
    ff = fast.engine
    assert ff.gpu_lock is lock
    want = fast.forward(rows[:3])
    assert not lock.held and _other_process_gets_it(path)
    launched = fast.launch(rows[:3])
    assert launched is not None and launched._released.wait(10)
    assert not lock.held and _other_process_gets_it(path)   # the GPU is free before the collect
    taken = []
    t = threading.Thread(target=lambda: taken.append(ff._lock.acquire(blocking=False)))
    t.start()
    t.join()
    assert taken == [False]                                   # the engine's buffers are not, until it
    lg, p = launched.collect()
    np.testing.assert_array_equal(lg, want[0])
    np.testing.assert_array_equal(p, want[1])
    assert not lock.held and _other_process_gets_it(path)
    assert ff._lock.acquire(blocking=False)
    ff._lock.release()

    held, release = CTX.Event(), CTX.Event()
    other = CTX.Process(target=_hold, args=(path, held, release))
    other.start()
    try:
        assert held.wait(60)
        assert fast.launch(rows[:3]) is None          # nothing queued, and both locks given back
        assert not lock.held and ff._lock.acquire(blocking=False)
        ff._lock.release()
        release.set()
        lg2, p2 = fast.forward(rows[:3])              # waits for the other process, then runs
        np.testing.assert_array_equal(lg2, want[0])
        np.testing.assert_array_equal(p2, want[1])
        assert not lock.held
    finally:
        release.set()
        other.join(60)


def test_a_forward_stages_its_first_chunk_before_it_waits_for_the_gpu(bundle, rows, tmp_path):
    """The host work of a forward's first chunk is done while another process holds the GPU, so the GPU idles for
    none of it: slot 0's staging buffer holds the rows' ids before the lock is free, and the answers are the same."""
    path = str(tmp_path / "gpu.lock")
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=2048,
                        gpu_lock=GpuLock(path))
    ff = fast.engine
    want = fast.forward(rows[:3])
    host = ff._slots[0][0]
    held, release = CTX.Event(), CTX.Event()
    other = CTX.Process(target=_hold, args=(path, held, release))
    other.start()
    try:
        assert held.wait(60)
        host.zero_()
        out = []
        t = threading.Thread(target=lambda: out.append(fast.forward(rows[:3])))
        t.start()
        ids = rows[2].ids   # the longest row first, as the chunk is packed
        deadline = time.monotonic() + 30
        while not (host != 0).any() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (host != 0).any() and t.is_alive() and not out   # staged, still waiting for the GPU
        assert set(host.tolist()) >= set(ids[:4])
        release.set()
        t.join(60)
        np.testing.assert_array_equal(out[0][0], want[0])
        np.testing.assert_array_equal(out[0][1], want[1])
    finally:
        release.set()
        other.join(60)


@pytest.mark.gpu
def test_on_cuda_the_lock_goes_back_when_the_forward_event_completes(tmp_path):
    """A real CUDA event: the release waits for queued GPU work (a long matmul chain), then unlocks."""
    path = str(tmp_path / "gpu.lock")
    lock = GpuLock(path)
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    lock.acquire()
    for _ in range(200):
        x = x @ x * 1e-3
    done = torch.cuda.Event()
    done.record()
    released = lock.release_after(done)
    assert not done.query() and lock.held      # the GPU is still busy: nobody else may start
    assert released.wait(60) and done.query() and not lock.held
    lock.close()


def test_the_fast_backend_refuses_a_gpu_lock_that_is_not_one(bundle):
    with pytest.raises(ValueError, match="gpu_lock"):
        make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", gpu_lock="on")


def test_the_lock_counts_its_outermost_holds_and_the_time_they_lasted(tmp_path):
    lock = GpuLock(str(tmp_path / "gpu.lock"))
    with lock:
        with lock:   # an inner level is not another hold
            time.sleep(0.05)
        assert lock.acquisitions == 1 and lock.held_s == 0.0   # counted when the hold ends
    assert lock.acquisitions == 1 and 0.05 <= lock.held_s < 1.0
    with lock:
        pass
    assert lock.acquisitions == 2 and lock.held_s < 1.0
    lock.close()


def test_a_non_blocking_take_answers_at_once_while_a_thread_of_this_process_waits(holder, tmp_path):
    """While one thread of this process blocks for a lock another process holds, a non-blocking take (what an event
    loop's polled launch does) answers False at once rather than waiting behind that thread; once the holder lets
    go the waiting thread has the lock."""
    path, proc, release = holder
    mine = GpuLock(path)
    waiter = threading.Thread(target=mine.acquire)
    waiter.start()
    time.sleep(0.2)   # the thread is now inside the blocking take
    t = time.monotonic()
    assert not mine.acquire(blocking=False) and time.monotonic() - t < 0.1
    release.set()
    waiter.join(30)
    assert not waiter.is_alive() and mine.held and mine.waits == 1
    mine.release()
    assert _other_process_gets_it(path)
    mine.close()


def test_a_polled_forward_that_finds_the_gpu_lock_held_goes_to_the_forward_thread(tiny_checkpoint, rows, tmp_path):
    """While another process holds the GPU lock, a one-micro-batch call is not launched from the event loop: it goes
    to the forward thread, which waits for the lock, and answers as `score_rows` does; both locks are free after."""
    import asyncio

    from serve_app.scorer import Scorer

    path = str(tmp_path / "gpu.lock")
    scorer = Scorer(tiny_checkpoint, backend="fast", device="cpu", max_batch_tokens=2048,
                    backend_options={"ops": "torch", "max_batch_tokens": 2048, "gpu_lock": GpuLock(path)})
    scorer.poll_on_cpu = True
    few = rows[:3]
    want = scorer.score_rows(few)
    threaded = []
    real = scorer._score_rows
    scorer._score_rows = lambda rs: threaded.append(len(rs)) or real(rs)
    held, release = CTX.Event(), CTX.Event()
    other = CTX.Process(target=_hold, args=(path, held, release))
    other.start()
    try:
        assert held.wait(60)
        threading.Timer(0.3, release.set).start()
        lg, p = asyncio.run(scorer.score_rows_async(few))
    finally:
        release.set()
        other.join(60)
    np.testing.assert_array_equal(lg, want[0])
    np.testing.assert_array_equal(p, want[1])
    assert threaded == [len(few)]
    lock = scorer.gpu_lock
    assert lock.waits >= 1 and not lock.held and _other_process_gets_it(path)
    assert scorer.engine.backend.engine._lock.acquire(blocking=False)
    scorer.engine.backend.engine._lock.release()
    scorer.close()
