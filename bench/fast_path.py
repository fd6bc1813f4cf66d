"""Benchmark of the fast path against our eager bf16, upstream laya 0.4.15 (eager and tilelang) and the
GEMM floor, on one modernbert-large-shaped checkpoint, in one GPU run.

    python bench/fast_path.py --make modernbert-large --ckpt /tmp/ck --out-dir $OUT --budget-s 240

Sections (each timed, each allowed to fail without losing the others; later ones are skipped when
the time budget runs out): GEMM sweep + floor, the FP8 products (gemm8), fast build/warm-up (bf16, fp16,
FP8, and bf16 / fp16 with the add+LayerNorm fold from 1024 tokens up), numerics on 64 cases, latency workloads,
offline throughput, upstream. Writes fast_path_<date>.json (and a PNG when matplotlib imports) into --out-dir and
prints a table last. `--plot JSON` redraws the PNG from a JSON file.

The sweep's winners never change a product module: the engines this run builds get them as a proposed tuning
table (`tuning=`), which is printed and, with `--tuning-out FILE`, written in kernels/tuning.json's format, to
copy over that file when it should become what the forward runs. Candidates: bench/fastpath_sweep.py.

This file parses the flags and runs the sections in order; the sections, the workloads and the report live in
bench/fastpath/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:   # run as a script, Python puts bench/ on sys.path, not the checkout's root
    sys.path.insert(0, ROOT)

from bench.fastpath import attention_sweep, common, gemm8, gemm_sweep, model_sections, references, report, workloads  # noqa: E402

ENGINES = workloads.FAST + ("eager", "fp32")
SECTIONS = ("gemm", "gemm8", "add_ln", "attention", "numerics", "latency", "profile", "offline", "hf", "upstream")


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The flags, checked (an unknown section or candidate tag is an error), and the attention tags to skip."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default="/tmp/laya-bench-ckpt")
    ap.add_argument("--make", default=None, help="make-checkpoint shape to build at --ckpt first")
    ap.add_argument("--wait-ckpt", type=float, default=0, help="seconds to wait for --ckpt to appear")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--max-batch-tokens", type=int, default=65536)
    ap.add_argument("--gemm-m", type=int, default=65536)
    ap.add_argument("--cases", type=int, default=64)
    ap.add_argument("--offline-states", type=int, default=2048)
    ap.add_argument("--upstream-offline-states", type=int, default=256)
    ap.add_argument("--skip", nargs="*", default=[],
                    help="sections to skip: gemm gemm8 add_ln attention numerics latency profile offline hf upstream")
    # the ping-pong engines only when named: a kernel that faults the GPU would take the run's CUDA context with it
    ap.add_argument("--engines", nargs="*", default=[x for x in ENGINES if x not in workloads.PINGPONG],
                    help="engines to build: fast (bf16) fast16 fast8 fold fold16 eager fp32 (numerics needs fp32), "
                         "and pingpong foldpp fast8pp when named")
    ap.add_argument("--plot", default=None, help="only redraw the PNG from this JSON")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    ap.add_argument("--attention-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip-attention", default="", help="attention candidate tags (comma-separated) not to run")
    ap.add_argument("--skip-manual", default="",
                    help="tags of bench/fastpath_sweep.py GEMM_WS alternatives (comma-separated) not to time or run")
    ap.add_argument("--tuning-out", default=None, metavar="FILE",
                    help="write this run's proposed tuning table (kernels/tuning.json's format) to FILE")
    ap.add_argument("--heads", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=28, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    skip_attn = [t for t in a.skip_attention.split(",") if t]
    if skip_attn:   # a misspelt tag would silently run its candidate
        from bench.fastpath_sweep import ATTENTION

        tags = [c.tag() for c in ATTENTION]
        bad = [t for t in skip_attn if t not in tags]
        if bad:
            ap.error("--skip-attention: unknown %s (candidates: %s)" % (", ".join(bad), ", ".join(tags)))
    skip_manual = [t for t in a.skip_manual.split(",") if t]
    if skip_manual:
        from bench.fastpath_sweep import GEMM_WS

        tags = [c.tag() for alts in GEMM_WS.values() for c in alts]
        bad = [t for t in skip_manual if t not in tags]
        if bad:
            ap.error("--skip-manual: unknown %s (alternatives: %s)" % (", ".join(bad), ", ".join(tags)))
        for g, alts in GEMM_WS.items():   # the candidates this run times (a benchmark's own list)
            GEMM_WS[g] = tuple(c for c in alts if c.tag() not in skip_manual)
    if any(x not in ENGINES for x in a.engines):
        ap.error("--engines: unknown %s (use %s)" % (", ".join(x for x in a.engines if x not in ENGINES),
                                                     " ".join(ENGINES)))
    if any(x not in SECTIONS for x in a.skip):  # a misspelt section would silently run
        ap.error("--skip: unknown %s (use %s)" % (", ".join(x for x in a.skip if x not in SECTIONS),
                                                 ", ".join(SECTIONS)))
    return a, skip_attn


def main(argv=None) -> int:
    """Run the benchmark; returns the exit status."""
    a, skip_attn = parse_args(argv)
    if a.attention_child:
        return attention_sweep.attention_child(a.attention_child.split(","), a.heads, a.layers)
    if a.plot:
        with open(a.plot) as fh:
            res = json.load(fh)
        png = a.plot[:-5] + ".png"
        print("wrote %s" % png if report.plot(res, png) else "matplotlib missing")
        return 0
    return run(a, skip_attn)


def run(a: argparse.Namespace, skip_attn: list[str]) -> int:
    """Every section not skipped, in order, saving the JSON after each; the table and the proposal last."""
    import torch

    common.DEVICE = a.device
    if a.device == "cpu":
        a.skip = list(a.skip) + ["gemm"]
    budget = common.Budget(a.budget_s)
    res: dict = {"date": dt.date.today().isoformat(),
                 "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (dry run)",
                 "torch": torch.__version__, "args": vars(a),
                 # LAYA_FLEET_COMMIT first: the GPU machine's copy of the checkout can carry stale git metadata
                 "commit": os.environ.get("LAYA_FLEET_COMMIT") or subprocess.run(
                     ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()}
    try:
        from kernels import _tl
        from model.backends.fast import configure_tilelang

        configure_tilelang()   # the node-local kernel cache the fast backend uses
        res["tilelang"] = _tl.tl()[0].__version__
    except ImportError:
        res["tilelang"] = None
    os.makedirs(a.out_dir, exist_ok=True)
    out_json = os.path.join(a.out_dir, "fast_path_%s.json" % res["date"])

    def save():
        with open(out_json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)

    if a.make:
        from model.make_checkpoint import make_checkpoint

        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_checkpoint(a.ckpt, a.make, seed=0)
        common.log("checkpoint %s in %.1fs" % (a.make, time.perf_counter() - t))
    from model.backends.fast import flops_per_token
    from model.bundle import open_bundle

    b = None
    if "gemm" not in a.skip:
        from model.make_checkpoint import SHAPES

        s = SHAPES[a.make or "modernbert-large"]
        dims = dict(d=s["hidden"], inter=s["ff"], ffn=4 * s["hidden"], layers=s["layers"], head_layers=2)
        try:
            gemm_sweep.section_gemm(res, dims, a.gemm_m)
        except Exception:
            res.setdefault("errors", {})["gemm"] = traceback.format_exc()
            common.log(traceback.format_exc())
        save()
    if "gemm8" not in a.skip and a.device == "cuda":
        from model.make_checkpoint import SHAPES

        s = SHAPES[a.make or "modernbert-large"]
        try:
            gemm8.section_gemm8(res, dict(d=s["hidden"], inter=s["ff"]), a.gemm_m)
        except Exception:
            res.setdefault("errors", {})["gemm8"] = traceback.format_exc()
            common.log(traceback.format_exc())
        save()
    if "add_ln" not in a.skip and a.device == "cuda":
        from model.make_checkpoint import SHAPES

        try:
            gemm_sweep.section_add_ln(res, SHAPES[a.make or "modernbert-large"]["hidden"], a.gemm_m)
        except Exception:
            res.setdefault("errors", {})["add_ln"] = traceback.format_exc()
            common.log(traceback.format_exc())
        save()
    attn_cfg = None
    if "attention" not in a.skip:
        try:
            attn_cfg = attention_sweep.section_attention(
                res, 16 if (a.make or "modernbert-large") == "modernbert-large" else 12,
                28 if (a.make or "modernbert-large") == "modernbert-large" else 22, skip=tuple(skip_attn))
        except Exception:
            res.setdefault("errors", {})["attention"] = traceback.format_exc()
            common.log(traceback.format_exc())
        save()
    t_wait = time.perf_counter() + a.wait_ckpt
    while not os.path.isfile(os.path.join(a.ckpt, "rl_agent_config.json")) and time.perf_counter() < t_wait:
        time.sleep(1)
    b = open_bundle(a.ckpt)
    ec = b.encoder_config
    flops_tok = flops_per_token(ec.hidden_size, ec.num_hidden_layers, ec.intermediate_size, 2, 4 * ec.hidden_size)
    res["flops_per_token"] = flops_tok
    engines = {}
    for name in a.engines:
        try:
            engines.update(workloads.make_engines(a.ckpt, [name], a.max_batch_tokens, a.device, attn_cfg))
            res.setdefault("load", {})[name] = engines[name][1]
        except Exception:
            res.setdefault("errors", {})["load_" + name] = traceback.format_exc()
            common.log(traceback.format_exc())
    save()
    short = workloads.short_words(next(iter(engines.values()))[0]) if engines else 34
    wl = workloads.workloads(offline_states=a.offline_states, short=short)
    model_sections.encode_probe(res, engines, wl, "after_load")
    sections = [("numerics", lambda: model_sections.section_numerics(res, engines, a.cases, a.ckpt)),
                ("probe", lambda: model_sections.encode_probe(res, engines, wl, "after_numerics")),
                ("latency", lambda: model_sections.section_latency(res, engines, wl)),
                ("profile", lambda: model_sections.section_profile(res, engines, wl)),
                ("offline", lambda: model_sections.section_offline(res, engines, wl, flops_tok, budget)),
                ("probe", lambda: model_sections.encode_probe(res, engines, wl, "after_offline")),
                ("hf", lambda: references.section_hf(res, a.ckpt, a.device, budget))]
    for name, fn in sections:
        if name in a.skip or budget.left() < 20:
            common.log("section %s skipped" % name)
            continue
        try:
            fn()
        except Exception:
            res.setdefault("errors", {})[name] = traceback.format_exc()
            common.log(traceback.format_exc())
        save()
    if "fast" in engines:
        res["load"]["fast"]["stats"] = engines["fast"][0].backend.stats.as_dict()
    n_up = min(a.upstream_offline_states, a.offline_states)
    any_eng = next(iter(engines.values()))[0] if engines else None
    up_tokens = sum(len(r) for r in workloads.rows_of(any_eng, [(wl["offline"][0][:n_up], wl["offline"][1])])[0]) \
        if any_eng else 0
    engines.clear()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    if "upstream" not in a.skip:
        try:
            references.section_upstream(res, a.ckpt, wl, up_tokens, budget, n_up)
        except Exception:
            res.setdefault("errors", {})["upstream"] = traceback.format_exc()
    res["elapsed_s"] = time.perf_counter() - common.T0
    save()
    png = out_json[:-5] + ".png"
    res["png"] = png if report.plot(res, png) else None
    save()
    print(report.table(res))
    report.print_proposal(res, a.tuning_out)
    save()
    if res.get("errors"):
        print("errors in: %s" % ", ".join(res["errors"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
