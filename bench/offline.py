"""Offline scoring benchmark: Parquet to Parquet through Ray Data and the scorer actors, compared in the same
run with the in-process Scorer path (one process: read, tokenize, Scorer.score_rows, decode, write) on the
same files.

    python bench/offline.py --checkpoint /models/laya --backend auto --rows 100000 \\
        --out bench/results/offline_h200.json

Rows are mixed-length e-mail-like texts (short, medium, long, and some longer than max_len), 0.1% nulls,
spread over --files Parquet files, answered against configs/example_questions.json (choice, score, noul).
The target is offline tokens/s >= 80% of in-process tokens/s per GPU, both measured after start-up (model
load and warm-up excluded; "after first batch" for the pipeline); wall-clock numbers including start-up
are reported beside them. Prints a table, writes the JSON to --out and a PNG next to it.
The in-process side runs in a child process so the two never share a GPU.
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
def inprocess(args) -> dict:
    """One process, no Ray: read each file, tokenize, Scorer.score_rows per batch, decode, write; timed."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from serve_app.scorer import Scorer

    if not torch.cuda.is_available() or args.device == "cpu":  # same threads as one CPU scorer actor
        torch.set_num_threads(max(1, int(args.cpus_per_actor)))
    questions = json.load(open(QUESTIONS))
    t0 = time.perf_counter()
    scorer = Scorer(args.checkpoint, backend=args.backend, device=args.device, cache_dir=args.cache_dir,
                    max_batch_tokens=args.max_batch_tokens)
    engine = scorer.engine
    prepared = engine.prepare(questions)
    from serve_app.offline.schema import output_fields

    schema = pa.schema([pa.field("id", pa.int64())] + output_fields(prepared))
    t_ready = time.perf_counter()
    tokens = rows = 0
    os.makedirs(args.inprocess_out, exist_ok=True)
    for path in sorted(glob.glob(os.path.join(args.data, "part-*.parquet"))):
        t = pq.read_table(path, columns=["id", "text"])
        ids, texts = t.column("id").to_pylist(), t.column("text").to_pylist()
        out = []
        for s in range(0, len(texts), args.batch_size):
            chunk = [(i, x) for i, x in zip(ids[s:s + args.batch_size], texts[s:s + args.batch_size])]
            good = [(i, x) for i, x in chunk if x is not None and x.strip()]
            encs = engine.encode_many([x for _, x in good], prepared)
            all_rows = [r for e in encs for r in e.rows]
            logits, act = scorer.score_rows(all_rows)
            pos = 0
            for (i, _), e in zip(good, encs):
                n = len(e.rows)
                res = engine.decode(prepared, e, logits[pos:pos + n], act[pos:pos + n])
                pos += n
                rec = {"id": i, "input_tokens": res["usage"]["input_tokens"], "truncated": res["usage"]["truncated"],
                       "error": None}
                for qid, a in res["answers"].items():
                    rec[qid] = a.get("choice", a.get("score", a.get("noul")))
                    rec[qid + "_confidence"] = a["confidence"]
                    rec[qid + "_answer_confidence"] = a["answer_confidence"]
                    probs = a.get("probabilities") or {"false": round(1 - a["noul"], 4), "true": a["noul"]}
                    rec[qid + "_probabilities"] = [(str(k), v) for k, v in probs.items()]
                out.append(rec)
                tokens += e.tokens
            rows += len(chunk)
        pq.write_table(pa.Table.from_pylist(out, schema=schema),
                       os.path.join(args.inprocess_out, os.path.basename(path)))
    t_end = time.perf_counter()
    run_s = t_end - t_ready
    st = scorer.stats
    return {"rows": rows, "tokens": tokens, "startup_s": round(t_ready - t0, 3), "run_s": round(run_s, 3),
            "tokens_per_s": round(tokens / run_s, 1), "tokens_per_s_incl_startup": round(tokens / (t_end - t0), 1),
            "forward_s": round(st.forward_s, 3), "budget": scorer.budget, "backend": engine.backend_name,
            "device": str(engine.device),
            "padding_overhead": 0.0 if scorer.packed else round(st.padded_tokens / max(1, st.tokens) - 1, 4)}


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
    """Bars of tokens/s (offline vs in-process) and the offline run's tokens over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    off, inp = res["offline"], res.get("inprocess") or {}
    bars = [("offline\nafter start-up", off["tokens_per_s_after_ready"] or 0),
            ("offline\nwall", off["tokens_per_s"] or 0)]
    if inp:
        bars += [("in-process\nafter load", inp["tokens_per_s"]),
                 ("in-process\nwall", inp["tokens_per_s_incl_startup"])]
    ax1.bar([b[0] for b in bars], [b[1] for b in bars], color=["C0", "C0", "C1", "C1"][:len(bars)])
    for i, (_, v) in enumerate(bars):
        ax1.text(i, v, "%.0f" % v, ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("input tokens / s")
    ratio = res.get("ratio_after_startup_per_gpu")
    ax1.set_title("%s rows, %s GPU(s), %s%s" % (res["rows"], off["gpus"], ",".join(off["backend"]),
                                                  ("; offline/in-process = %.0f%%" % (100 * ratio)) if ratio else ""))
    tl = off.get("timeline") or []
    if tl:
        ax2.step([p[0] for p in tl], [p[2] for p in tl], where="post", label="tokens written")
        if off.get("seconds_to_scorers_ready"):
            ax2.axvline(off["seconds_to_scorers_ready"], color="grey", ls="--", label="scorers ready")
        ax2.legend(loc="upper left")
        ax2.set_xlabel("seconds since the run started")
        ax2.set_ylabel("input tokens written")
        ax2.set_title("offline run: budgets %s, padding %.1f%%" % (off["budgets"], 100 * off["padding_overhead"]))
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def env_info() -> dict:
    """Versions and hardware of this run."""
    info = {"python": platform.python_version(), "host_cpus": os.cpu_count(), "date": dt.date.today().isoformat()}
    try:
        import ray
        import torch

        info.update(torch=torch.__version__, ray=ray.__version__, cuda=torch.version.cuda,
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
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
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--device", default=None, help="in-process device (default: CUDA when available)")
    p.add_argument("--address", default=None, help="Ray cluster (default: a new local one)")
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument("--inprocess-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inprocess-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", RuntimeWarning)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.inprocess_only:  # the child process
        print(json.dumps(inprocess(args)))
        return 0

    work = args.work_dir or tempfile.mkdtemp(prefix="bench-offline-")
    data = os.path.join(work, "data")
    log("making %d rows in %d files under %s" % (args.rows, args.files, data))
    make_data(data, args.rows, args.files)
    from serve_app import offline

    off_out = os.path.join(work, "out-offline")
    cfg = offline.OfflineConfig(input=[data], output=off_out, questions=QUESTIONS, state_column="text",
                                id_column="id", checkpoint=args.checkpoint, backend=args.backend,
                                num_gpus=args.num_gpus,
                                num_actors=args.num_actors, cpus_per_actor=args.cpus_per_actor,
                                max_batch_tokens=args.max_batch_tokens, batch_size=args.batch_size,
                                cache_dir=args.cache_dir, overwrite=True, address=args.address, progress_interval=15,
                                ray_progress=False)
    log("offline run (Ray Data)")
    if os.path.isdir(off_out):
        import shutil

        shutil.rmtree(off_out)
    summary = offline.run(cfg)
    log(offline.format_summary(summary))
    try:
        import ray

        ray.shutdown()
    except Exception:  # pragma: no cover
        pass

    res = {"env": env_info(), "rows": args.rows, "files": args.files, "checkpoint": os.path.abspath(args.checkpoint),
           "offline": {k: v for k, v in summary.items() if k != "config"}, "inprocess": None}
    if not args.skip_inprocess:
        log("in-process run (child process, same files)")
        in_out = os.path.join(work, "out-inprocess")
        cmd = [sys.executable, os.path.abspath(__file__), "--inprocess-only", "--checkpoint", args.checkpoint,
               "--backend", args.backend, "--data", data, "--inprocess-out", in_out,
               "--batch-size", str(args.batch_size), "--cpus-per-actor", str(args.cpus_per_actor)]
        for flag, v in (("--device", args.device), ("--cache-dir", args.cache_dir),
                        ("--max-batch-tokens", args.max_batch_tokens)):
            if v is not None:
                cmd += [flag, str(v)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log("in-process run failed:\n" + r.stderr[-3000:])
            return 1
        res["inprocess"] = json.loads(r.stdout.strip().splitlines()[-1])
        res["agreement"] = compare_outputs(off_out, in_out)
        gpus = max(1, summary["gpus"] or summary["actors"])
        inp = res["inprocess"]
        if summary["tokens_per_s_after_ready"]:
            res["ratio_after_startup_per_gpu"] = round(summary["tokens_per_s_after_ready"] / gpus / inp["tokens_per_s"],
                                                       4)
        res["ratio_wall_per_gpu"] = round(summary["tokens_per_s"] / gpus / inp["tokens_per_s_incl_startup"], 4)
        res["target_met"] = bool(res.get("ratio_after_startup_per_gpu", 0) >= 0.8)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(res, png)
    print(table(res))
    print("wrote %s and %s" % (args.out, png))
    return 0


def table(res: dict) -> str:
    """The result as a text table."""
    off, inp = res["offline"], res.get("inprocess")
    rows = [("path", "rows", "tokens", "start-up s", "run s", "tokens/s (run)", "tokens/s (wall)", "padding")]
    off_run = off["seconds"] - (off["seconds_to_scorers_ready"] or 0)
    rows.append(("offline (Ray Data, %d actor(s), %d GPU)" % (off["actors"], off["gpus"]), off["rows"], off["tokens"],
                 off["seconds_to_scorers_ready"], round(off_run, 1), off["tokens_per_s_after_ready"],
                 off["tokens_per_s"], "%.1f%%" % (100 * off["padding_overhead"])))
    if inp:
        rows.append(("in-process Scorer (%s, %s)" % (inp["backend"], inp["device"]), inp["rows"], inp["tokens"],
                     inp["startup_s"], inp["run_s"], inp["tokens_per_s"], inp["tokens_per_s_incl_startup"],
                     "%.1f%%" % (100 * inp["padding_overhead"])))
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    if inp:
        lines.append("offline / in-process per GPU: %.0f%% after start-up (target >= 80%%: %s), %.0f%% wall; "
                     "token budgets %s; labels agree %.2f%%, max |d value| %g" % (
                         100 * res.get("ratio_after_startup_per_gpu", 0), "met" if res.get("target_met") else "NOT met",
                         100 * res["ratio_wall_per_gpu"], off["budgets"], 100 * res["agreement"]["label_agreement"],
                         res["agreement"]["max_abs_diff_value"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
