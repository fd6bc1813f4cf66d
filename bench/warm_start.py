"""Warm start: time from process start to ready, per backend and cache state, in fresh processes.

    python bench/warm_start.py --device cuda --shape mmbert-base          # the GPU machine
    python bench/warm_start.py --device cpu --shape tiny --rows compile,aot   # anywhere (small)

Each row is a new Python process (`--child`) that imports, runs `model.load(...)` and `Engine.warmup()`,
and reports when it is ready; the parent times it from just before spawning. Rows:

* `<backend> cold`: empty shared cache and empty node-local dir (compiles, publishes);
* `<backend> warm`: the shared cache another process populated, a fresh node-local dir (what a new
  replica on a new node sees);
* for `aot` the cold row builds the package (`build=True`) and the warm row loads it;
* `peak`: on CUDA, the compile path's peak activation memory at 32 rows x 1024 tokens (or max_len) with
  the alignment fix (tokens declared a multiple of 16) and without it (tokens padded the same but
  declared as a plain dynamic size), plus eager for reference.

After "ready" each child also checks answers against the fp32 eager model on the same device
(max |dp| over option probabilities and P(action 0), argmax agreement) and counts graphs compiled after
warm-up (recompiles). Prints a table, writes bench/results/warm_start_<tag>.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {("fast", "warm"): 15.0, ("compile", "warm"): 20.0, ("aot", "warm"): 20.0, ("compile", "cold"): 90.0}
CACHE_ENV = ("LAYA_FLEET_CACHE_DIR", "LAYA_FLEET_LOCAL_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
             "TILELANG_CACHE_DIR")


# -- child ------------------------------------------------------------------------------------------
def _random_rows(n: int, max_len: int, vocab: int, seed: int):
    from model.sequence import Row

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        L = rng.randint(16, max_len)
        k = rng.randint(1, min(8, L - 1))
        rows.append(Row([rng.randrange(5, vocab) for _ in range(L)], sorted(rng.sample(range(1, L), k)),
                        rng.randrange(3)))
    return rows


def _batches(rows, budget: int):
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(rows[i]) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


def _score_all(engine, rows, batches):
    import numpy as np

    kmax = max(len(r.markers) for r in rows)
    logits = np.full((len(rows), kmax), -1e4, dtype=np.float32)
    act = np.zeros(len(rows), dtype=np.float32)
    for idx in batches:
        lg, ap = engine.score([rows[i] for i in idx])
        logits[idx, :lg.shape[1]] = lg
        act[idx] = ap
    return logits, act


def _probs(logits):
    import numpy as np

    z = logits - logits.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


CALL_SHAPES = ((1, 83), (3, 83), (30, 512))  # rows x tokens: one decision, one request, a large batch


def _call_times(engine, repeats: int = 20) -> dict:
    """Median and best wall ms of one engine.score call per CALL_SHAPES entry (after 3 unmeasured calls each):
    what a ready replica's forward costs, to compare backends (and regional against whole-graph compile)."""
    import statistics

    import torch

    out = {}
    vocab = len(engine.bundle.tokenizer)
    for n, L in CALL_SHAPES:
        L = min(L, engine.bundle.max_len)
        rows = _random_rows(n, L, vocab, seed=n)
        rows = [type(r)(r.ids + [5] * (L - len(r.ids)), r.markers, r.qtype) for r in rows]  # exactly L tokens
        times = []
        for i in range(3 + repeats):
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            engine.score(rows)  # returns host arrays: the call includes the device sync
            if i >= 3:
                times.append((time.perf_counter() - t) * 1000.0)
        out["%dx%d" % (n, L)] = {"median": round(statistics.median(times), 3), "best": round(min(times), 3)}
    return out


def _peak(engine, rows: int, tokens: int) -> dict:
    """Peak allocated GPU memory above the resting level for one forward of rows x tokens (second call);
    on CPU only the call times (peak_mib None: no allocator statistics there)."""
    import torch

    from model.sequence import Row

    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fill = engine.bundle.tokenizer.cls_token_id
    batch = [Row([fill] * tokens, [1, 2, 3], 0) for _ in range(rows)]
    t = time.perf_counter()
    engine.score(batch)  # compiles / autotunes this size if it has to
    sync()
    first = time.perf_counter() - t
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    engine.score(batch)
    sync()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"rows": rows, "tokens": tokens, "peak_mib": peak, "first_call_s": first, "call_s": time.perf_counter() - t}


def _progress(out: dict, what: str) -> None:
    """A timestamped stage line on stderr (a timed-out child's log then shows where it was)."""
    print("[+%.1fs] %s" % (time.time() - out["t_child_start"], what), file=sys.stderr, flush=True)


def child(spec: dict) -> dict:
    """Run one row in this (fresh) process; returns its measurements."""
    t_import = time.time()
    import torch

    import model
    from model.backends import BackendUnavailable

    if spec["device"] == "cpu":
        torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    if spec["backend"] != "fast":  # dynamo's counters; the fast path itself never imports dynamo (~1.5 s)
        from torch._dynamo.utils import counters
    else:
        import collections

        counters = collections.defaultdict(collections.Counter)

    out: dict = {"t_import_done": time.time(), "t_child_start": t_import}
    prof = None
    if spec.get("profile"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        engine = model.load(spec["checkpoint"], device=spec["device"], backend=spec["backend"],
                            cache_dir=spec["cache_dir"], **spec.get("options", {}))
    except BackendUnavailable as e:
        return {"skipped": str(e)}
    out["t_loaded"] = time.time()
    _progress(out, "loaded")
    if spec.get("warmup", True):
        engine.warmup(spec.get("budget"))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    out["t_ready"] = time.time()
    if prof is not None:
        prof.disable()
        prof.dump_stats(spec["profile"] + ".prof")
    _progress(out, "ready")
    out["backend"] = engine.backend_name
    out["cache"] = engine.cache.report() if engine.cache is not None else None
    out["graphs_at_ready"] = counters["stats"]["unique_graphs"]
    out["inductor"] = {k: v for k, v in counters["inductor"].items() if "cache" in k}
    if hasattr(engine.backend, "precompile_state"):  # compile: did the saved graph load, and did its guards hold
        out["precompile"] = {"state": engine.backend.precompile_state, "misses": engine.backend.precompile_misses}
        out["regional"] = bool(getattr(engine.backend, "regional", False))
    print("\nPARTIAL " + json.dumps(out), flush=True)  # what a timed-out child still reports
    if spec.get("timing"):
        out["call_ms"] = _call_times(engine)
        _progress(out, "calls timed")
    if spec.get("peak"):
        out["peak"] = _peak(engine, *spec["peak"])
        _progress(out, "peak measured")
        if spec.get("peak_eager"):
            del engine
            eager = model.load(spec["checkpoint"], device=spec["device"], backend="eager")
            out["peak_eager"] = _peak(eager, *spec["peak"])
            return out
    if spec.get("accuracy"):
        import numpy as np

        ref = model.load(spec["checkpoint"], device=spec["device"], backend="eager", dtype=torch.float32)
        _progress(out, "fp32 reference loaded")
        # lengths up to 1024: what serving sees; an 8192-token eager fp32 reference would dominate the row
        rows = _random_rows(spec["accuracy"], min(1024, engine.bundle.max_len), len(engine.bundle.tokenizer), seed=1)
        batches = _batches(rows, spec.get("budget") or 8192)
        lg, ap = _score_all(engine, rows, batches)
        rlg, rap = _score_all(ref, rows, batches)
        k = np.array([len(r.markers) for r in rows])
        p, rp = _probs(lg), _probs(rlg)
        valid = np.arange(lg.shape[1])[None, :] < k[:, None]
        out["accuracy"] = {
            "rows": len(rows), "batches": len(batches),
            "max_dp": float(np.abs(np.where(valid, p - rp, 0)).max()),
            "max_dp_act": float(np.abs(ap - rap).max()),
            "argmax_agree": float((lg.argmax(1) == rlg.argmax(1)).mean()),
            "max_dlogit": float(np.abs(np.where(valid, lg - rlg, 0)).max())}
        out["recompiles_after_ready"] = counters["stats"]["unique_graphs"] - out["graphs_at_ready"]
        if "precompile" in out:
            out["precompile"]["misses_after_checks"] = engine.backend.precompile_misses
    return out


# -- parent -----------------------------------------------------------------------------------------
def start_row(args, name: str, backend: str, state: str, cache_dir: str, local: str, deadline: float,
              **spec) -> dict:
    """Spawn one child for a row; returns a handle for `finish_row` (or the row, if out of time)."""
    left = deadline - time.time()
    row = {"name": name, "backend": backend, "state": state}
    if left < 15:
        row["skipped"] = "out of time"
        return {"row": row}
    full = {"checkpoint": args.checkpoint, "device": args.device, "backend": backend, "cache_dir": cache_dir,
            "budget": args.budget, "threads": args.threads, **spec}
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    env.update({"LAYA_FLEET_LOCAL_CACHE_DIR": local, "PYTHONPATH": os.pathsep.join(
        [p for p in (ROOT, os.environ.get("PYTHONPATH")) if p])})
    log_path = None
    if args.profile:  # cProfile of load + warm-up, `-X importtime` and the whole stderr, per row
        os.makedirs(args.profile, exist_ok=True)
        full["profile"] = log_path = os.path.join(args.profile, name.replace(" ", "_"))
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    t0 = time.time()
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(full)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return {"row": row, "proc": p, "t0": t0, "deadline": deadline, "log": log_path}


def finish_row(h: dict) -> dict:
    """Wait for a started row's child and return the row (timings relative to its spawn)."""
    row, p = h["row"], h.get("proc")
    if p is None:
        return row
    try:
        stdout, stderr = p.communicate(timeout=max(1.0, h["deadline"] - time.time()))
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
        row["skipped"] = "timed out (deadline)"
        row["log_tail"] = "--- stderr tail ---\n%s\n--- stdout tail ---\n%s" % (stderr[-4000:], stdout[-1000:])
        partial = [x[x.index("PARTIAL {"):] for x in stdout.splitlines() if "PARTIAL {" in x]
        if not partial:
            return row
        del row["skipped"]
        row["incomplete"] = "timed out after ready: accuracy / peak unfinished"
        stdout = "RESULT " + partial[-1][8:]
        p.returncode = 0
    if h.get("log"):
        with open(h["log"] + ".stderr.log", "w") as fh:
            fh.write(stderr)
        stderr = "\n".join(x for x in stderr.splitlines() if not x.startswith("import time:"))
    # a library may have left a partial line on stdout: find the marker anywhere in a line
    lines = [x[x.index("RESULT {"):] for x in stdout.splitlines() if "RESULT {" in x]
    if p.returncode != 0 or not lines:
        tb = stderr.rfind("Traceback (most recent call last)")
        if tb < 0:  # a native crash: faulthandler's thread stacks come first, its long module list last
            tb = stderr.rfind("Fatal Python error")
        before = stderr[max(0, tb - 2000):tb] if tb > 0 else ""  # a native library's own message, if any
        row["error"] = "exit %s; %s\n--- stderr before it ---\n%s\n--- stderr tail ---\n%s\n--- stdout tail ---\n%s" % (
            p.returncode, stderr[tb:tb + 6000] if tb >= 0 else "no Python traceback (killed or crashed?)",
            before, stderr[-3000:], stdout[-1500:])
        return row
    r = json.loads(lines[-1][7:])
    if "skipped" in r:
        row["skipped"] = r["skipped"][:300]
        return row
    t0 = h["t0"]
    row.update(r)
    row["import_s"] = r["t_import_done"] - t0
    row["load_s"] = r["t_loaded"] - r["t_import_done"]
    row["warmup_s"] = r["t_ready"] - r["t_loaded"]
    row["ready_s"] = r["t_ready"] - t0
    target = TARGETS.get((row["backend"], row["state"]))
    if target is not None:
        row["target_s"], row["meets_target"] = target, row["ready_s"] <= target
    return row


def run_row(*args, **kw) -> dict:
    """start_row + finish_row."""
    return finish_row(start_row(*args, **kw))


def _fmt(row: dict) -> str:
    if "ready_s" not in row:
        return "%-22s %s" % (row["name"], row.get("skipped") or ("ERROR " + row.get("error", "")[:600]))
    cache = row.get("cache") or {}
    seeded = ",".join("%s:%s" % (k, v["state"]) for k, v in (cache.get("seeded") or {}).items()) or "-"
    pub = ",".join("%s:%s" % kv for kv in (cache.get("published") or {}).items()) or "-"
    acc = row.get("accuracy") or {}
    acc_s = ("dp %.4f act %.4f agree %.3f" % (acc["max_dp"], acc["max_dp_act"], acc["argmax_agree"])) if acc else ""
    tgt = ("<= %.0f %s" % (row["target_s"], "ok" if row["meets_target"] else "MISS")) if "target_s" in row else ""
    pre = row.get("precompile")
    if row.get("regional"):
        acc_s += " | regional, %s graphs" % row.get("graphs_at_ready")
    elif pre:
        acc_s += " | precompile %s, guard misses %s" % (pre["state"], pre.get("misses_after_checks", pre["misses"]))
    return "%-22s %7.1f %6.1f %6.1f %7.1f  %-10s %-28s %-22s %s" % (
        row["name"], row["ready_s"], row["import_s"], row["load_s"], row["warmup_s"], tgt, seeded, pub, acc_s)


def _plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in result["rows"] if "ready_s" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    names = [r["name"] for r in rows]
    parts = [("import_s", "import"), ("load_s", "load + seed"), ("warmup_s", "warm-up (compile) + publish")]
    left = [0.0] * len(rows)
    for key, label in parts:
        vals = [r[key] for r in rows]
        ax.barh(names, vals, left=left, label=label)
        left = [a + b for a, b in zip(left, vals)]
    for i, r in enumerate(rows):
        if "target_s" in r:
            ax.plot([r["target_s"]] * 2, [i - 0.4, i + 0.4], "k--", lw=1)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start to ready (dashed: target)")
    ax.set_title("warm start, %s, %s" % (result["env"]["device_name"], result["checkpoint_shape"]))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _env(device: str) -> dict:
    import torch

    from model import cache

    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    return {"device": device, "device_name": name, "torch": torch.__version__, "versions": cache.versions(),
            "arch": cache.device_arch(device), "cpus": os.cpu_count(), "python": platform.python_version()}


def main(argv=None) -> int:
    """Run the benchmark; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help="a checkpoint dir (default: make one of --shape under --work)")
    ap.add_argument("--shape", default="tiny", help="make-checkpoint shape when no --checkpoint is given")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--rows", default="compile,peak,aot,fast",
                    help="comma list, run in this order: compile (its default, regional='auto'), regional "
                         "(regional=True), whole (regional=False), aot, fast (cold + warm rows each), peak; "
                         "$LAYA_FLEET_CUDA_AMP=fp16 runs every row in fp16")
    ap.add_argument("--parallel-peak", action="store_true",
                    help="run the no-align peak child alongside the rows after it (it measures memory, not time)")
    ap.add_argument("--accuracy-rows", type=int, default=None, help="rows checked against fp32 eager")
    ap.add_argument("--budget", type=int, default=None, help="token budget per batch (warm-up and checks)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per child")
    ap.add_argument("--work", default=None, help="scratch dir for caches (default: a temp dir, removed)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--tag", default=None, help="result file suffix (default: cpu / gpu name)")
    ap.add_argument("--deadline-s", type=float, default=3000.0, help="skip rows that would start after this")
    ap.add_argument("--row-timeout-s", type=float, default=1e9, help="stop one row's child after this long")
    ap.add_argument("--profile", default=None,
                    help="dir: per row, a cProfile of load + warm-up (.prof) and the child's stderr with -X importtime")
    args = ap.parse_args(argv)
    known = ("fast", "compile", "regional", "whole", "aot", "peak")
    order = [x for x in args.rows.split(",") if x]
    if any(x not in known for x in order):  # a misspelt row would silently measure nothing
        ap.error("--rows: unknown %s (use %s)" % (", ".join(x for x in order if x not in known), ", ".join(known)))
    if args.child:
        import faulthandler

        faulthandler.enable()  # a crash in native code still leaves a Python stack on stderr
        spec = json.loads(args.child)
        res = child(spec)
        print("\nRESULT " + json.dumps(res), flush=True)
        return 0

    t_start = time.time()
    deadline = t_start + args.deadline_s
    sys.path.insert(0, ROOT)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device == "cuda"
    args.budget = args.budget or (16384 if cuda else 2048)
    args.accuracy_rows = args.accuracy_rows or (256 if cuda else 48)
    work = args.work or tempfile.mkdtemp(prefix="warm_start-")
    os.makedirs(work, exist_ok=True)
    if not args.checkpoint:
        from model.make_checkpoint import make_checkpoint

        args.checkpoint = os.path.join(work, "ckpt-" + args.shape)
        if not os.path.isfile(os.path.join(args.checkpoint, "model.safetensors")):
            t = time.time()
            make_checkpoint(args.checkpoint, args.shape, seed=0)
            print("made %s checkpoint in %.1fs" % (args.shape, time.time() - t), flush=True)
    from model.bundle import open_bundle

    max_len = open_bundle(args.checkpoint).max_len
    tag = args.tag or ("cpu" if not cuda else torch.cuda.get_device_name().split()[-1].lower())
    result = {"env": _env(args.device), "checkpoint": args.checkpoint, "checkpoint_shape": args.shape,
              "max_len": max_len, "budget": args.budget, "cuda_amp": os.environ.get("LAYA_FLEET_CUDA_AMP"),
              "targets": {"%s %s" % k: v for k, v in TARGETS.items()},
              "rows": []}
    os.makedirs(args.out_dir, exist_ok=True)
    out_json = os.path.join(args.out_dir, "warm_start_%s.json" % tag)

    def d(*parts):
        return os.path.join(work, *parts)

    def row_deadline():
        return min(deadline, time.time() + args.row_timeout_s)

    def add(row):
        result["rows"].append(row)
        print(_fmt(row), flush=True)
        with open(out_json, "w") as fh:
            json.dump(result, fh, indent=1)

    print("%-22s %7s %6s %6s %7s  %-10s %-28s %-22s %s" % ("row", "ready_s", "import", "load", "warmup", "target",
                                                          "seeded", "published", "vs fp32 eager"), flush=True)
    acc = {"accuracy": args.accuracy_rows}
    peak_tokens = min(1024, max_len)
    if not cuda:
        order = [x for x in order if x != "fast"]  # TileLang kernels need CUDA
    background = None
    for item in order:
        if item == "peak":
            h = start_row(args, "compile no-align peak", "compile", "peak", d("noalign", "shared"),
                          d("noalign", "node"), deadline, options={"align": False}, warmup=False,
                          peak=[32, peak_tokens])
            if args.parallel_peak and item != order[-1]:
                background = h  # its number is memory, not time: let it overlap the next rows
                h["row"]["note"] = "ran concurrently with the rows after it"
            else:
                add(finish_row(h))
            continue
        shared = d(item, "shared")
        opts = {"options": {"build": True}} if item == "aot" else {}
        backend = item
        if item in ("regional", "whole"):  # the compile backend with one graph per kind of encoder layer / one
            backend, opts = "compile", {"options": {"regional": item == "regional"}}   # graph (default: auto)
        cold = run_row(args, "%s cold" % item, backend, "cold", shared, d(item, "node1"), row_deadline(), **acc,
                       **opts)
        if background is not None and item == "aot":
            cold["note"] = "built while the no-align peak child compiled alongside"
        add(cold)
        if "ready_s" not in cold:
            continue
        extra = {"peak": [32, peak_tokens], "peak_eager": True} if (item == "compile" and "peak" in order) else {}
        if item == "fast":  # the warm fast row loads kernels through the index (kernels/_tl.py): check answers too
            extra.update(acc)
        if item in ("regional", "whole"):
            extra.update(opts)
        extra["timing"] = True
        add(run_row(args, "%s warm" % item, backend, "warm", shared, d(item, "node2"), row_deadline(), **extra))
    if background is not None:
        add(finish_row(background))
    result["total_s"] = time.time() - t_start
    with open(out_json, "w") as fh:
        json.dump(result, fh, indent=1)
    png = _plot(result, out_json[:-5] + ".png")
    peaks = {r["name"]: r for r in result["rows"] if "peak" in r}
    for name, r in peaks.items():
        mib = r["peak"]["peak_mib"]
        eager = (r.get("peak_eager") or {}).get("peak_mib")
        print("32x%d forward, %-22s peak %s%s, call %.3fs (first %.1fs)" % (
            r["peak"]["tokens"], name, "n/a" if mib is None else "%.0f MiB" % mib,
            "" if eager is None else " (eager %.0f MiB)" % eager, r["peak"]["call_s"], r["peak"]["first_call_s"]))
    timed = [r for r in result["rows"] if r.get("call_ms")]
    if timed:
        shapes = list(timed[0]["call_ms"])
        print("per call, ms (median / best of 20): " + "  ".join("%14s" % s for s in shapes))
        for r in timed:
            print("  %-31s" % r["name"] + "  ".join("%14s" % ("%.2f / %.2f" % (r["call_ms"][s]["median"],
                                                                             r["call_ms"][s]["best"]))
                                                   for s in shapes))
    print("wrote %s%s (%.0fs)" % (out_json, " and " + png if png else "", result["total_s"]), flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
