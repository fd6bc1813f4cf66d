"""The embedded local Ray's reaper: ends what the offline driver started once the driver is gone, however it died.

`ray.init()` without an address starts a GCS, a raylet, a dashboard and their agents as children of the driver;
a SIGKILLed driver takes the first three with it, but an agent can outlive it by a minute or more while it tries
to report to the dead GCS. `start(pid)` runs this file as a process of its own session: it follows the driver's
descendants while the driver lives, then SIGKILLs the ones still running (each checked by its start time, so a
reused pid is left alone) and exits. Linux only (it reads /proc); elsewhere `start` does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot) from /proc, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(root: int, skip: frozenset[int] = frozenset()) -> set[int]:
    """The pids of every process below `root` in the process tree, less the subtrees of `skip`."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found and c not in skip:
                found.add(c)
                todo.append(c)
    return found


def watch(driver: int, skip: frozenset[int] = frozenset(), interval: float = 0.5, trace: str | None = None) -> None:
    """Follow `driver`'s descendants (less the subtrees of `skip`) until it exits, then SIGKILL those still running.
    `trace`: a file rewritten after each scan with the pids followed, one per line (what a caller can wait on)."""
    me, seen = os.getpid(), {}
    born = start_time(driver)
    while born is not None and start_time(driver) == born:
        for pid in descendants(driver, skip | {me}) - set(seen):
            t = start_time(pid)
            if t is not None:
                seen[pid] = t
        if trace:
            with open(trace + ".tmp", "w") as fh:
                fh.write("".join("%d\n" % p for p in sorted(seen)))
            os.replace(trace + ".tmp", trace)
        time.sleep(interval)
    for pid, t in seen.items():
        if start_time(pid) == t:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start(driver: int, skip: set[int] | frozenset[int] = frozenset(),
          trace: str | None = None) -> subprocess.Popen | None:
    """Start the reaper of `driver`'s processes but the subtrees of `skip` (the children it had before it started
    Ray), in a session of its own; returns it, or None off Linux. `trace`: see `watch`."""
    if not os.path.isdir("/proc/%d" % driver):
        return None
    extra = ["--trace", trace] if trace else []
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *extra, str(driver), *map(str, sorted(skip))],
                            start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    args, trace = sys.argv[1:], None
    if args[:1] == ["--trace"]:
        trace, args = args[1], args[2:]
    watch(int(args[0]), frozenset(map(int, args[1:])), trace=trace)
