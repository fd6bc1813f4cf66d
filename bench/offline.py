"""Offline scoring benchmark: Parquet to Parquet through Ray Data and the scorer actors, against the in-process
Scorer path on the same files and the in-process forward alone on the same rows, in one run.

    python bench/offline.py --make modernbert-large --checkpoint /tmp/ck_large --rows 100000 \\
        --out bench/results/offline_h200.json

Rows are mixed-length e-mail-like texts (short, medium, long, and some longer than max_len), 0.1% nulls,
spread over --files Parquet files, answered against configs/example_questions.json (choice, score, noul).
First, in a child process (so the two never share a GPU, and the kernel cache is warm for the offline actors):
read, tokenize, Scorer.score_rows per batch (tokenizing overlapped with the forward), decode, write; then the
forward alone over a sample of those rows at each budget, whose best is the reference. Then the offline job with
its defaults. The targets (issue 27): offline tokens/s after start-up >= 0.95 of the forward's best per GPU,
start-up <= 20 s, in-process end to end >= 0.9 of the forward's best. Prints a table (the start-up piece by
piece), writes the JSON to --out and a PNG next to it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

QUESTIONS = os.path.join(ROOT, "configs", "example_questions.json")
WORDS = ("order refund late broken invoice payment password login error crash urgent angry happy thanks please "
         "help ticket price plan upgrade cancel shipping address product quality spam offer free click link "
         "security policy account delivery the a my your we is was not and or but with for from this that it "
         "to of in on at bonjour merci danke gracias").split()
# (share of rows, min words, max words): short chats to long threads; the last bucket overflows max_len
LENGTHS = [(0.40, 5, 30), (0.35, 30, 150), (0.20, 150, 400), (0.05, 400, 1200)]


def log(msg: str) -> None:
    """Progress to stderr (the table goes to stdout)."""
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


def make_data(d: str, rows: int, files: int, seed: int = 0) -> list[str]:
    """Write `rows` mixed-length states over `files` Parquet files under `d` (reused if present)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    marker = os.path.join(d, "_made_%d_%d_%d" % (rows, files, seed))
    paths = [os.path.join(d, "part-%03d.parquet" % i) for i in range(files)]
    if os.path.exists(marker):
        return paths
    os.makedirs(d, exist_ok=True)
    rng = random.Random(seed)
    per = [rows // files + (1 if i < rows % files else 0) for i in range(files)]
    k = 0
    for i, n in enumerate(per):
        ids, texts = [], []
        for _ in range(n):
            lo, hi = _bucket(rng.random())
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
            ids.append(k)
            texts.append(None if rng.random() < 0.001 else "Subject: order %d\n%s" % (rng.randint(1000, 9999), words))
            k += 1
        pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.string())}), paths[i],
                       row_group_size=4096)
    open(marker, "w").close()
    return paths


def _bucket(r: float) -> tuple[int, int]:
    acc = 0.0
    for share, lo, hi in LENGTHS:
        acc += share
        if r < acc:
            return lo, hi
    return LENGTHS[-1][1:]


# -- the in-process baseline (child process) ------------------------------------------------------
FORWARD_BUDGETS = (16384, 32768, 65536, 131072)


def _record(i, res: dict) -> dict:
    """One output row of the in-process path (the offline job's columns for the example questions)."""
    rec = {"id": i, "input_tokens": res["usage"]["input_tokens"], "truncated": res["usage"]["truncated"], "error": None}
    for qid, a in res["answers"].items():
        rec[qid] = a.get("choice", a.get("score", a.get("noul")))
        rec[qid + "_confidence"] = a["confidence"]
        rec[qid + "_answer_confidence"] = a["answer_confidence"]
        probs = a.get("probabilities") or {"false": round(1 - a["noul"], 4), "true": a["noul"]}
        rec[qid + "_probabilities"] = [(str(k), v) for k, v in probs.items()]
    return rec


def inprocess(args) -> dict:
    """One process, no Ray: read, tokenize, Scorer.score_rows per batch, decode, write, timed; then the forward
    alone over a sample of the same rows at each budget (the in-process forward's best).

    The scorer measures its budget as the offline actors do (throughput goal, probe rows of the job's lengths from
    `serve_app.offline.sizing`'s sample). Batch k is scored on a second thread while the main thread encodes batch
    k + 1 and decodes batch k - 1, so the end-to-end rate is what one process reaches with tokenizing overlapped.
    """
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from serve_app import offline
    from serve_app.offline.schema import output_fields
    from serve_app.offline.sizing import take_sample
    from serve_app.scorer import Scorer

    if not torch.cuda.is_available() or args.device == "cpu":  # same threads as one CPU scorer actor
        torch.set_num_threads(max(1, int(args.cpus_per_actor)))
    questions = json.load(open(QUESTIONS))
    files = sorted(glob.glob(os.path.join(args.data, "part-*.parquet")))[:args.inprocess_files or None]
    t0 = time.perf_counter()
    job = offline.prepare_job(offline.OfflineConfig(input=files, output=args.inprocess_out, questions=QUESTIONS,
                                                    state_column="text", id_column="id", checkpoint=args.checkpoint))
    sample = take_sample(job, job.files)
    scorer = Scorer(args.checkpoint, backend=args.backend, device=args.device, cache_dir=args.cache_dir,
                    max_batch_tokens=args.max_batch_tokens, budget_goal="throughput",
                    probe_lengths=sample.row_lengths)
    engine = scorer.engine
    prepared = engine.prepare(questions)
    schema = pa.schema([pa.field("id", pa.int64())] + output_fields(prepared))
    t_ready = time.perf_counter()
    tokens = rows = 0
    kept: list = []   # rows of the first batches, for the forward-only measurement
    os.makedirs(args.inprocess_out, exist_ok=True)
    outputs: dict[str, list] = {}
    left = {}
    batches = []
    for path in files:
        t = pq.read_table(path, columns=["id", "text"])
        ids, texts = t.column("id").to_pylist(), t.column("text").to_pylist()
        starts = range(0, len(texts), args.batch_size)
        left[path] = len(starts)
        outputs[path] = []
        batches += [(path, ids[s:s + args.batch_size], texts[s:s + args.batch_size]) for s in starts]

    def finish(item) -> None:
        nonlocal tokens, rows
        path, good, encs, fut, n_chunk = item
        logits, act = fut.result()
        pos = 0
        for (i, _), e in zip(good, encs):
            n = len(e.rows)
            outputs[path].append(_record(i, engine.decode(prepared, e, logits[pos:pos + n], act[pos:pos + n])))
            pos += n
            tokens += e.tokens
        rows += n_chunk
        left[path] -= 1
        if not left[path]:
            pq.write_table(pa.Table.from_pylist(outputs.pop(path), schema=schema),
                           os.path.join(args.inprocess_out, os.path.basename(path)))

    inflight: deque = deque()
    with ThreadPoolExecutor(1, thread_name_prefix="bench-score") as pool:
        for path, ids, texts in batches:
            good = [(i, x) for i, x in zip(ids, texts) if x is not None and x.strip()]
            encs = engine.encode_many([x for _, x in good], prepared)
            all_rows = [r for e in encs for r in e.rows]
            if sum(len(r) for r in kept) < args.forward_sample_tokens:
                kept += all_rows
            inflight.append((path, good, encs, pool.submit(scorer.score_rows, all_rows), len(ids)))
            if len(inflight) > 1:  # batch k - 1 decodes while batch k is on the GPU
                finish(inflight.popleft())
        while inflight:
            finish(inflight.popleft())
    t_end = time.perf_counter()
    run_s = t_end - t_ready
    st = scorer.stats
    out = {"rows": rows, "files": len(files), "tokens": tokens, "startup_s": round(t_ready - t0, 3),
           "run_s": round(run_s, 3), "tokens_per_s": round(tokens / run_s, 1),
           "tokens_per_s_incl_startup": round(tokens / (t_end - t0), 1), "forward_s": round(st.forward_s, 3),
           "forward_tokens_per_s_in_run": round(st.tokens / st.forward_s, 1) if st.forward_s else None,
           "budget": scorer.budget, "budget_probe": dict(st.budget_probe), "backend": engine.backend_name,
           "device": str(engine.device), "scorer_startup": scorer.info()["startup"],
           "padding_overhead": 0.0 if scorer.packed else round(st.padded_tokens / max(1, st.tokens) - 1, 4)}
    out["forward"] = forward_best(scorer, kept, args.forward_budgets)
    return out


def forward_best(scorer, rows: list, budgets) -> dict:
    """Tokens/s of the forward alone over `rows` (one `score_rows` call: the scorer cuts and pipelines the chunks)
    at each budget that fits the backend's chunks, and the best; the best budget is timed twice."""
    chunk = scorer.engine.backend.chunk_tokens
    chosen = scorer.budget
    cands = sorted({b for b in budgets if chunk is None or b <= chunk} | {chosen})
    tokens = sum(len(r) for r in rows)
    warm = rows[:max(1, len(rows) // 16)]

    def rate(b: int) -> float:
        scorer.set_budget(b)
        scorer.score_rows(warm)
        t = time.perf_counter()
        scorer.score_rows(rows)
        return tokens / (time.perf_counter() - t)

    by = {b: rate(b) for b in cands}
    top = max(by, key=by.get)
    by[top] = max(by[top], rate(top))
    scorer.set_budget(chosen)
    return {"tokens": tokens, "rows": len(rows), "by_budget": {str(b): round(v) for b, v in by.items()},
            "best_tokens_per_s": round(by[top]), "best_budget": top, "scorer_budget": chosen,
            "scorer_budget_vs_best": round(by[chosen] / by[top], 4)}


def compare_outputs(offline_dir: str, inprocess_dir: str) -> dict:
    """How closely the two outputs agree: label agreement and max |difference| of expected score / P(true)."""
    import numpy as np
    import pyarrow.parquet as pq

    agree = total = 0
    maxdiff = 0.0
    for path in sorted(glob.glob(os.path.join(inprocess_dir, "*.parquet"))):
        a = pq.read_table(path).to_pandas().set_index("id")
        b = pq.read_table(os.path.join(offline_dir, os.path.basename(path))).to_pandas().set_index("id")
        b = b.loc[a.index]
        agree += int((a["intent"] == b["intent"]).sum())
        total += len(a)
        for c in ("urgency", "angry"):
            maxdiff = max(maxdiff, float(np.nanmax(np.abs(a[c].to_numpy(float) - b[c].to_numpy(float)))))
    return {"label_agreement": round(agree / max(1, total), 6), "max_abs_diff_value": round(maxdiff, 6),
            "rows_compared": total}


def plot(res: dict, png: str) -> None:
    """Bars of tokens/s (offline, in-process end to end, the in-process forward's best) and the offline run's
    tokens over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    off, inp = res["offline"], res.get("inprocess") or {}
    bars = [("offline\nafter start-up", off["tokens_per_s_after_ready"] or 0, "C0"),
            ("offline\nwall", off["tokens_per_s"] or 0, "C0")]
    if inp:
        bars += [("in-process\nend to end", inp["tokens_per_s"], "C1"),
                 ("in-process\nforward best", inp["forward"]["best_tokens_per_s"], "C2")]
    ax1.bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    for i, (_, v, _) in enumerate(bars):
        ax1.text(i, v, "%.0f" % v, ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("input tokens / s")
    ratio = (res.get("targets") or {}).get("offline_vs_forward_best", {}).get("value")
    ax1.set_title("%s rows, %s GPU(s), %s%s" % (res["rows"], off["gpus"], ",".join(off["backend"]),
                                                  ("; offline/forward best = %.0f%%" % (100 * ratio)) if ratio else ""))
    tl = off.get("timeline") or []
    if tl:
        ax2.step([p[0] for p in tl], [p[2] for p in tl], where="post", label="tokens written")
        if off.get("seconds_to_scorers_ready"):
            ax2.axvline(off["seconds_to_scorers_ready"], color="grey", ls="--", label="scorers ready")
        ax2.legend(loc="upper left")
        ax2.set_xlabel("seconds since the first input was listed")
        ax2.set_ylabel("input tokens written")
        ax2.set_title("offline run: budgets %s, padding %.1f%%" % (off["budgets"], 100 * off["padding_overhead"]))
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def ray_bytecode(ray_module) -> bool:
    """Whether the imported Ray package's own modules have up-to-date bytecode (as an install leaves them)."""
    import importlib.util

    probe = os.path.join(os.path.dirname(ray_module.__file__), "_private", "worker.py")
    try:
        return os.path.getmtime(importlib.util.cache_from_source(probe)) >= os.path.getmtime(probe)
    except OSError:
        return False


def env_info() -> dict:
    """Versions and hardware of this run."""
    info = {"python": platform.python_version(), "host_cpus": os.cpu_count(), "date": dt.date.today().isoformat()}
    try:
        import ray
        import torch

        info.update(torch=torch.__version__, ray=ray.__version__, cuda=torch.version.cuda,
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
        # without bytecode every Ray process compiles its imports: the start-up measured is then the harness's
        info["ray_bytecode"] = ray_bytecode(ray)
        if not info["ray_bytecode"]:
            log("warning: Ray's modules have no bytecode yet; the start-up measured includes compiling them")
    except Exception:  # pragma: no cover
        pass
    try:
        # LAYA_FLEET_COMMIT first: the GPU machine's copy of the checkout can carry stale git metadata
        info["commit"] = os.environ.get("LAYA_FLEET_COMMIT") or subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:  # pragma: no cover
        pass
    return info


def main(argv=None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--make", default=None, help="make-checkpoint shape to build at --checkpoint first (if absent)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--rows", type=int, default=100000)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "offline_%s.json" % dt.date.today()),
                   help="result JSON path; the PNG goes next to it")
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--work-dir", default=None, help="where data and outputs go (default: a temporary directory)")
    p.add_argument("--num-gpus", type=int, default=None, help="offline GPUs (default: all; 0 = CPU actors)")
    p.add_argument("--num-actors", type=int, default=None, help="CPU scorer actors when no GPU is used")
    p.add_argument("--cpus-per-actor", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--tokenize-tasks", type=int, default=None, help="offline tokenize tasks (default: sized)")
    p.add_argument("--decode-tasks", type=int, default=None, help="offline decode tasks (default: sized)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--device", default=None, help="in-process device (default: CUDA when available)")
    p.add_argument("--address", default=None, help="Ray cluster (default: a new local one)")
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument("--inprocess-files", type=int, default=None,
                   help="in-process end to end over the first N files only (default: all)")
    p.add_argument("--forward-sample-tokens", type=int, default=2_000_000,
                   help="tokens of the job's rows the in-process forward is timed on, per budget")
    p.add_argument("--forward-budgets", default=",".join(map(str, FORWARD_BUDGETS)),
                   help="budgets the in-process forward is timed at (plus the scorer's own)")
    p.add_argument("--inprocess-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inprocess-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.forward_budgets = [int(b) for b in str(args.forward_budgets).split(",") if b.strip()]
    warnings.simplefilter("ignore", RuntimeWarning)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.inprocess_only:  # the child process
        print(json.dumps(inprocess(args)))
        return 0

    t_bench = time.perf_counter()
    if args.make and not os.path.isdir(args.checkpoint):
        from model.make_checkpoint import make_checkpoint

        t = time.perf_counter()
        make_checkpoint(args.checkpoint, args.make, seed=0)
        log("checkpoint %s in %.1f s" % (args.make, time.perf_counter() - t))
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-offline-")
    data = os.path.join(work, "data")
    log("making %d rows in %d files under %s" % (args.rows, args.files, data))
    make_data(data, args.rows, args.files)
    res = {"env": env_info(), "rows": args.rows, "files": args.files, "checkpoint": os.path.abspath(args.checkpoint),
           "args": {k: v for k, v in vars(args).items() if k not in ("inprocess_only", "data", "inprocess_out")},
           "inprocess": None}
    in_out = os.path.join(work, "out-inprocess")
    if not args.skip_inprocess:
        # first, in its own process (the two never share the GPU): it also leaves the kernel cache warm for the
        # offline actors, whose start-up target assumes a warm cache
        log("in-process run (child process)")
        res["inprocess"] = run_inprocess(args, data, in_out)
        if res["inprocess"] is None:
            return 1
    log("offline run (Ray Data)")
    summary = run_offline(args, data, os.path.join(work, "out-offline"))
    res["offline"] = {k: v for k, v in summary.items() if k != "config"}
    if res["inprocess"]:
        res["agreement"] = compare_outputs(os.path.join(work, "out-offline"), in_out)
    res.update(ratios(summary, res["inprocess"]))
    res["bench_s"] = round(time.perf_counter() - t_bench, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(res, png)
    print(table(res))
    print("wrote %s and %s" % (args.out, png))
    return 0


def run_inprocess(args, data: str, out: str) -> dict | None:
    """The in-process side in a child process; its result, or None (logged) when it failed."""
    import shutil

    if os.path.isdir(out):  # outputs of an earlier run in the same --work-dir would be compared too
        shutil.rmtree(out)
    cmd = [sys.executable, os.path.abspath(__file__), "--inprocess-only", "--checkpoint", args.checkpoint,
           "--backend", args.backend, "--data", data, "--inprocess-out", out, "--batch-size", str(args.batch_size),
           "--cpus-per-actor", str(args.cpus_per_actor), "--forward-sample-tokens", str(args.forward_sample_tokens),
           "--forward-budgets", ",".join(map(str, args.forward_budgets))]
    for flag, v in (("--device", args.device), ("--cache-dir", args.cache_dir),
                    ("--max-batch-tokens", args.max_batch_tokens), ("--inprocess-files", args.inprocess_files)):
        if v is not None:
            cmd += [flag, str(v)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        log("in-process run failed:\n" + r.stderr[-3000:])
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_offline(args, data: str, out: str) -> dict:
    """The offline job over `data` into `out` with the job's defaults (what the flags leave unset); its summary."""
    import shutil

    from serve_app import offline

    if os.path.isdir(out):
        shutil.rmtree(out)
    cfg = offline.OfflineConfig(input=[data], output=out, questions=QUESTIONS, state_column="text",
                                id_column="id", checkpoint=args.checkpoint, backend=args.backend,
                                num_gpus=args.num_gpus, num_actors=args.num_actors, cpus_per_actor=args.cpus_per_actor,
                                max_batch_tokens=args.max_batch_tokens, batch_size=args.batch_size,
                                tokenize_tasks=args.tokenize_tasks, decode_tasks=args.decode_tasks,
                                cache_dir=args.cache_dir, overwrite=True, address=args.address, progress_interval=15,
                                ray_progress=False)
    summary = offline.run(cfg)
    log(offline.format_summary(summary))
    try:
        import ray

        ray.shutdown()
    except Exception:  # pragma: no cover
        pass
    return summary


# issue targets: (key, what, target, higher is better)
TARGETS = (("offline_vs_forward_best", "offline after start-up / in-process forward's best, per GPU", 0.95, True),
           ("startup_s", "offline start-up to the first scorer ready, s", 20.0, False),
           ("inprocess_e2e_vs_forward_best", "in-process end to end / forward's best", 0.9, True))


def ratios(summary: dict, inp: dict | None) -> dict:
    """The ratios and targets of the run (per GPU: the offline rates are divided by the GPUs, or CPU actors)."""
    gpus = max(1, summary["gpus"] or summary["actors"])
    after = summary["tokens_per_s_after_ready"]
    su = summary.get("startup") or {}
    values = {"startup_s": su.get("total_s")}
    out: dict = {"per_gpu": gpus}
    if inp:
        best = inp["forward"]["best_tokens_per_s"]
        values["offline_vs_forward_best"] = round(after / gpus / best, 4) if after else None
        values["inprocess_e2e_vs_forward_best"] = round(inp["tokens_per_s"] / best, 4)
        if after:
            out["ratio_after_startup_per_gpu"] = round(after / gpus / inp["tokens_per_s"], 4)
        out["ratio_wall_per_gpu"] = round(summary["tokens_per_s"] / gpus / inp["tokens_per_s_incl_startup"], 4)
    targets = {}
    for key, what, target, higher in TARGETS:
        v = values.get(key)
        met = None if v is None else (v >= target if higher else v <= target)
        targets[key] = {"what": what, "value": v, "target": target, "met": met}
    out["targets"] = targets
    return out


def _cols(rows: list[tuple]) -> list[str]:
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return lines


def table(res: dict) -> str:
    """The result as text: the runs, the in-process forward per budget, start-up piece by piece, the targets."""
    from serve_app.offline.summary import PIECES

    off, inp = res["offline"], res.get("inprocess")
    rows = [("path", "rows", "tokens", "start-up s", "run s", "tokens/s (run)", "tokens/s (wall)", "forward tok/s",
             "budget", "padding")]
    off_run = off["seconds"] - (off["seconds_to_scorers_ready"] or 0)
    fwd = off["scorer_tokens"] / off["forward_s"] if off["forward_s"] else None
    rows.append(("offline (Ray Data, %d actor(s), %d GPU)" % (off["actors"], off["gpus"]), off["rows"], off["tokens"],
                 (off.get("startup") or {}).get("total_s"), round(off_run, 1), off["tokens_per_s_after_ready"],
                 off["tokens_per_s"], fwd and round(fwd / max(1, res["per_gpu"])), off["budgets"],
                 "%.1f%%" % (100 * off["padding_overhead"])))
    if inp:
        rows.append(("in-process end to end (%s, %s, %d files)" % (inp["backend"], inp["device"], inp["files"]),
                     inp["rows"], inp["tokens"], inp["startup_s"], inp["run_s"], inp["tokens_per_s"],
                     inp["tokens_per_s_incl_startup"], inp["forward_tokens_per_s_in_run"], inp["budget"],
                     "%.1f%%" % (100 * inp["padding_overhead"])))
        f = inp["forward"]
        rows.append(("in-process forward, best of budgets", f["rows"], f["tokens"], "", "", f["best_tokens_per_s"], "",
                     f["best_tokens_per_s"], f["best_budget"], ""))
    lines = _cols(rows)
    if inp:
        f = inp["forward"]
        lines.append("in-process forward by budget (tokens/s): %s; the scorer's probe chose %s (%.1f%% of the best); "
                     "probe %s" % (f["by_budget"], f["scorer_budget"], 100 * f["scorer_budget_vs_best"],
                                   inp["budget_probe"]))
    su = off.get("startup")
    if su:
        lines.append("offline start-up %.1f s: %s; first batch %s s after; all actors ready at %s s" % (
            su["total_s"], ", ".join("%s %s" % (label, su[k]) for k, label in PIECES if su.get(k) is not None),
            su["first_batch_s"], su["actors_ready_s"]))
    st = off.get("stages")
    if st:
        lines.append("offline CPU stages: %d tokenize, %d decode task(s) (sample: %s tokens/s per CPU tokenizing, "
                     "%s decoding); budget probe %s" % (st["tokenize_tasks"], st["decode_tasks"],
                                                       st["tokenize_tokens_per_cpu_s"], st["decode_tokens_per_cpu_s"],
                                                       off.get("budget_probe")))
    for key, t in res["targets"].items():
        lines.append("target %-30s %-8s %s %s: %s" % (key, t["value"], ">=" if key != "startup_s" else "<=",
                                                      t["target"], {True: "met", False: "NOT met",
                                                                    None: "not measured"}[t["met"]]))
    if res.get("agreement"):
        a = res["agreement"]
        lines.append("offline vs in-process outputs: labels agree %.2f%% over %d rows, max |d value| %g" % (
            100 * a["label_agreement"], a["rows_compared"], a["max_abs_diff_value"]))
    lines.append("benchmark wall time %s s" % res.get("bench_s"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
