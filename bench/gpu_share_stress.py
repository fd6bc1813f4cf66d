"""Several scorer processes sharing one GPU, as configs/prod.yaml's replicas do: does any forward stall?

Two of eight `serve_load.py` runs of prod.yaml on an H200 lost two of the three replicas mid-run: their
requests hung until Serve's 60 s request timeout, the GPU stayed 100% busy with no load left, and a lone
request's forward took 3.3 ms instead of 2.0. This reproduces the GPU side without Ray or HTTP: `--procs`
processes each load a `Scorer` exactly as a replica does (default backend, warm-up, budget probe), then
score batches of 1..`--max-requests` requests of 1 state x the 3 example questions, drawn like
serve_load's bodies, back to back through `score_rows_async` (the replica's path: polled launch for one
micro-batch, the forward thread otherwise). The parent watches each process's last finished forward; one
older than `--stall-s` is a stall, and the child's Python stacks are dumped (faulthandler) beside the JSON.
Prints a table, writes JSON and a PNG of forwards/s per process and GPU utilization over time; exits 2 on a
stall. `--gemm-cluster 1` runs every hand-warp-specialised GEMM one block a tile (it stalled as well),
`--no-gpu-lock` lets the processes' forwards overlap on the GPU as they did before the fast backend's
cross-process GPU lock (model/backends/gpu_lock.py; every stall above was without it), `--small-m 65536` runs
every bucket on the small GEMM tiles, `--trace` eager forwards with an event after each op, `--gdb` a GPU
core dump of the first stalled process (setting the driver's core-dump variables, under which no run has
stalled yet). Results: BENCHMARKS.md,
"Scorers sharing a GPU".

    python3 bench/gpu_share_stress.py --checkpoint /tmp/ck_large --procs 4 --seconds 480 \
        --out $OUT/gpu_share_stress.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def child(i: int, a: dict, last, count, waits, ready, go) -> None:
    """One replica-like scorer: load, warm up, then score random batches until told to stop."""
    import asyncio
    import faulthandler
    import random

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from serve_load import QUESTIONS, make_payloads

    from serve_app.scorer import Scorer

    if a["gemm_cluster"]:  # the hand-warp-specialised GEMMs' cluster size (kernels/tuning.py reads these)
        from dataclasses import replace

        import kernels.gemm_manual as gm

        gm.GEMM, gm.GEGLU = (replace(c, cluster=a["gemm_cluster"]) for c in (gm.GEMM, gm.GEGLU))
    options = {"use_graphs": False} if a["trace"] else {}
    if a["small_m"]:  # every bucket up to small_m tokens on the small tiles: no hand-warp-specialised GEMM runs
        from kernels.tuning import Tuning

        options["tuning"] = Tuning(small_m=a["small_m"])
    if a["no_gpu_lock"]:  # the scorers' forwards time-slice the GPU, as before model/backends/gpu_lock.py
        options["gpu_lock"] = None
    sc = Scorer(a["checkpoint"], backend="auto", device="auto", backend_options=options or None)
    eng = sc.engine
    ff = eng.backend.engine if a["trace"] else None
    qs = eng.prepare(QUESTIONS)
    pool = [enc.rows for enc in eng.encode_many([p["state"] for p in make_payloads(256, seed=i)], qs)]
    stacks = open(os.path.join(a["dir"], "stacks_%d.txt" % i), "w")
    ready.set()
    go.wait()
    rng = random.Random(i)

    def traced(rows) -> None:
        # eager forward with a CUDA event after every op: a stall names the first op whose event never fires
        ff._prof = []
        launched = ff.launch(rows)
        if launched is None:
            ff._prof = None
            return
        deadline = time.monotonic() + a["stall_s"]
        while not launched.ready():
            if time.monotonic() > deadline:
                ops = [(kind, b.query()) for kind, _, b in ff._prof]
                hung = next((j for j, (_, done) in enumerate(ops) if not done), None)
                stacks.write("stalled: %d ops queued, first not done: %s (op %s); ops before it done: %s\n" % (
                    len(ops), ops[hung][0] if hung is not None else "none", hung,
                    all(d for _, d in ops[:hung or 0])))
                stacks.write("ops: %s\n" % [k for k, _ in ops])
                stacks.flush()
                deadline = float("inf")
            time.sleep(0.0005)
        launched.collect()
        ff._prof = None

    async def loop() -> None:
        end = time.monotonic() + a["seconds"]
        while time.monotonic() < end:
            k = min(rng.choice((1, 1, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)), a["max_requests"])
            rows = [r for _ in range(k) for r in rng.choice(pool)]
            if ff is not None:
                traced(rows)
            else:
                faulthandler.dump_traceback_later(a["stall_s"], repeat=True, file=stacks)
                await sc.score_rows_async(rows)
                faulthandler.cancel_dump_traceback_later()
            count[i] += 1
            lock = sc.gpu_lock
            waits[i] = lock.waits if lock is not None else -1
            last[i] = time.monotonic()
            if rng.random() < 0.02:  # an idle gap now and then, as between one client's requests
                await asyncio.sleep(rng.random() * 0.01)

    asyncio.run(loop())
    stacks.close()


def smi(field: str) -> str | None:
    """One nvidia-smi query field of the first GPU, or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=" + field, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout.split()
        return out[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpu_util() -> float | None:
    u = smi("utilization.gpu")
    try:
        return float(u) if u is not None else None
    except ValueError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--stall-s", type=float, default=10.0, help="a forward older than this is a stall")
    p.add_argument("--max-requests", type=int, default=32, help="most requests per batch")
    p.add_argument("--trace", action="store_true",
                   help="eager forwards (no CUDA graphs) with an event after every op: a stall names the op")
    p.add_argument("--gemm-cluster", type=int, default=0, choices=(0, 1, 2), help="force this cluster size on the hand-"
                   "warp-specialised GEMMs (1: every one a block a tile; 0: the shipped configs)")
    p.add_argument("--small-m", type=int, default=0, help="run token buckets up to this many tokens on the small "
                   "GEMM tiles (65536: every bucket, so no hand-warp-specialised GEMM runs; 0: the shipped table)")
    p.add_argument("--no-gpu-lock", action="store_true", help="no cross-process GPU lock: the processes' forwards "
                   "overlap on the GPU and the driver time-slices them (the shipped fast backend holds the lock)")
    p.add_argument("--gdb", default="", help="cuda-gdb binary: on the first stall, take the stalled process's "
                   "GPU core dump and write what cuda-gdb reads in it (kernels, warps, PCs) to gdb_<i>.txt, end")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_share_stress.json"))
    a = p.parse_args(argv)
    if a.small_m < 0 or a.small_m % 64:
        p.error("--small-m must be a multiple of 64 (the token buckets' step)")
    if a.procs < 1 or a.seconds <= 0 or a.stall_s <= 0 or a.max_requests < 1:
        p.error("--procs and --max-requests must be at least 1, --seconds and --stall-s positive")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    args = {"checkpoint": a.checkpoint, "seconds": a.seconds, "stall_s": a.stall_s,
            "max_requests": a.max_requests, "dir": out_dir, "trace": a.trace,
            "gemm_cluster": a.gemm_cluster, "small_m": a.small_m, "no_gpu_lock": a.no_gpu_lock}
    if a.gdb:
        os.environ.update(CORE_ENV)  # the children inherit it
    ctx = mp.get_context("spawn")
    last = ctx.Array("d", a.procs, lock=False)
    count = ctx.Array("q", a.procs, lock=False)
    waits = ctx.Array("q", a.procs, lock=False)   # forwards that waited for another process's GPU lock
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(a.procs)]
    procs = [ctx.Process(target=child, args=(i, args, last, count, waits, readies[i], go), daemon=True)
             for i in range(a.procs)]
    t0 = time.monotonic()
    for pr in procs:
        pr.start()
    for r in readies:
        while not r.wait(1.0):
            if any(pr.exitcode not in (None, 0) for pr in procs):
                print("a scorer process failed to start", file=sys.stderr)
                return 1
    ready_s = time.monotonic() - t0
    print("%d scorers ready in %.1f s" % (a.procs, ready_s), flush=True)
    start = time.monotonic()
    for i in range(a.procs):
        last[i] = start
    go.set()
    timeline, stalls = [], {}
    prev = [0] * a.procs
    while time.monotonic() < start + a.seconds + a.stall_s:
        time.sleep(1.0)
        now = time.monotonic()
        c = list(count)
        timeline.append({"t": round(now - start, 1), "gpu_util": gpu_util(),
                         "forwards_per_s": [c[i] - prev[i] for i in range(a.procs)]})
        prev = c
        for i in range(a.procs):
            age = now - last[i]
            if age > a.stall_s and procs[i].is_alive() and now < start + a.seconds:
                s = stalls.setdefault(i, {"at_s": round(last[i] - start, 1), "forwards_before": c[i]})
                s["stalled_s"] = round(age, 1)
                if a.gdb and "gdb" not in s:
                    s["gdb"] = gpu_core(a.gdb, procs[i].pid, os.path.join(out_dir, "gdb_%d.txt" % i))
        if a.gdb and any("gdb" in s for s in stalls.values()):
            break
        if not any(pr.is_alive() for pr in procs):
            break
    for pr in procs:
        pr.join(timeout=5)
        if pr.is_alive():
            pr.kill()
    for i, s in stalls.items():
        with open(os.path.join(out_dir, "stacks_%d.txt" % i)) as fh:
            s["stack"] = fh.read()[-4000:]
    res = {"checkpoint": a.checkpoint, "procs": a.procs, "trace": a.trace, "gemm_cluster": a.gemm_cluster,
           "small_m": a.small_m, "gpu_lock": not a.no_gpu_lock, "lock_waits": list(waits),
           "seconds": a.seconds, "ready_s": round(ready_s, 1),
           "forwards": list(count), "exitcodes": [pr.exitcode for pr in procs],
           "stalls": {str(k): v for k, v in stalls.items()}, "timeline": timeline,
           "commit": os.environ.get("LAYA_FLEET_COMMIT"), "gpu_uuid": smi("uuid"),
           "core_dump_env": bool(a.gdb)}
    print("| process | forwards | forwards/s | waited for the GPU lock | stalled at s | stalled for s | exit |")
    print("|---|---|---|---|---|---|---|")
    for i in range(a.procs):
        s = stalls.get(i, {})
        print("| %d | %d | %.0f | %s | %s | %s | %s |" % (
            i, count[i], count[i] / a.seconds, waits[i] if waits[i] >= 0 else "no lock", s.get("at_s", "-"),
            s.get("stalled_s", "-"), procs[i].exitcode))
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, os.path.splitext(a.out)[0] + ".png")
    return 2 if stalls else 0


GDB_COMMANDS = ["info cuda kernels", "info cuda blocks", "info cuda sms", "info cuda warps", "x/8i $pc",
                "cuda thread (128,0,0)", "x/8i $pc", "cuda thread (256,0,0)", "x/8i $pc",
                "cuda block (1,0,0) thread (0,0,0)", "x/8i $pc", "cuda thread (128,0,0)", "x/8i $pc",
                "info cuda warps sm 1"]
# a user-triggered GPU core dump (writing to the driver's pipe) holds every resident warp's PC; no memory
CORE_ENV = {"CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1", "CUDA_COREDUMP_PIPE": "/tmp/lf_corepipe.%p",
            "CUDA_COREDUMP_FILE": "/tmp/lf_core.%p.nvcudmp",
            "CUDA_COREDUMP_GENERATION_FLAGS": "skip_global_memory,skip_shared_memory,skip_local_memory,"
                                              "skip_constbank_memory"}


def gpu_core(gdb: str, pid: int, path: str) -> str:
    """Which kernel a stalled process is stuck in: trigger its GPU core dump through the driver's pipe, then
    read the dump with cuda-gdb (kernels, blocks, warps, the instructions producer thread 0 and consumer
    threads 128 and 256 of blocks 0 and 1 sit at)."""
    core = "/tmp/lf_core.%d.nvcudmp" % pid
    try:
        fd = os.open("/tmp/lf_corepipe.%d" % pid, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"1")
        os.close(fd)
    except OSError as e:
        text = "could not trigger the core dump: %r" % e
    else:
        size, t = -1, time.monotonic()
        while time.monotonic() - t < 120:  # the dump is written when its size stops growing
            time.sleep(2.0)
            n = os.path.getsize(core) if os.path.exists(core) else -1
            if n > 0 and n == size:
                break
            size = n
        cmd = [gdb, "-batch", "-nx", "-ex", "target cudacore " + core] + [x for c in GDB_COMMANDS
                                                                           for x in ("-ex", c)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            text = "core %s: %d bytes\n%s\n--- stderr ---\n%s" % (core, size, r.stdout, r.stderr)
        except subprocess.TimeoutExpired as e:
            text = "cuda-gdb timed out: %s" % ((e.stdout or b"")[-4000:],)
    with open(path, "w") as fh:
        fh.write(text)
    print(text[-8000:], flush=True)
    return text[-8000:]


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t = [x["t"] for x in res["timeline"]]
    for i in range(res["procs"]):
        ax.plot(t, [x["forwards_per_s"][i] for x in res["timeline"]], label="process %d forwards/s" % i)
    ax2 = ax.twinx()
    ax2.plot(t, [x["gpu_util"] for x in res["timeline"]], "k:", label="GPU utilization %")
    ax2.set_ylim(0, 105)
    ax.set_xlabel("s")
    ax.set_ylabel("forwards/s")
    ax.set_title("%d scorers on one GPU, stalls: %s" % (res["procs"], sorted(res["stalls"]) or "none"))
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
