"""Benchmark of the fast path against our eager bf16, upstream laya 0.4.15 (eager and tilelang) and the
GEMM floor, on one modernbert-large-shaped checkpoint, in one GPU run.

    python bench/fast_path.py --make modernbert-large --ckpt /tmp/ck --out-dir $OUT --budget-s 240

Sections (each timed, each allowed to fail without losing the others; later ones are skipped when
the time budget runs out): GEMM sweep + floor, fast build/warm-up, numerics on 64 cases, latency
workloads, offline throughput, upstream. Writes fast_path_<date>.json (and a PNG when matplotlib
imports) into --out-dir and prints a table last. `--plot JSON` redraws the PNG from a JSON file.

The sweep's winners never change a product module: the engines this run builds get them as a proposed tuning
table (`tuning=`), which is printed and, with `--tuning-out FILE`, written in kernels/tuning.json's format, to
copy over that file when it should become what the forward runs. Candidates: bench/fastpath_sweep.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_PROPOSAL: dict = {}   # {"table": kernels.tuning.Tuning}: this run's winners over the committed table


def proposal():
    """The tuning table this run proposes: the committed one plus every winner measured so far."""
    from kernels.tuning import TABLE

    return _PROPOSAL.setdefault("table", TABLE)


def propose(op: str, key: str, cfg) -> None:
    """Record a measured winner in this run's proposed table (the engines built after it run it)."""
    _PROPOSAL["table"] = proposal().with_entry(op, key, cfg)

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, the MFU denominator
WORDS = ("order refund late broken invoice payment password login error crash urgent angry happy thanks "
         "please help ticket price plan upgrade cancel shipping address product quality spam offer free "
         "click link security policy route model question answer server database network timeout the a "
         "my your we is was not and or but with for from this that it to of in on at").split()
Q_CHOICE = {"type": "choice", "instructions": "Route this customer email to the team that should handle it.",
            "criteria": {"billing": "payments, invoices, refunds", "shipping": "delivery and tracking",
                         "tech": "login, crashes, errors", "other": "anything else"}}
Q_SCORE = {"type": "score", "instructions": "How urgent is this email?", "criteria": ["low", "medium", "high"]}
Q_NOUL = {"type": "noul", "instructions": "The customer asks for their money back."}
Q1 = {"route": Q_CHOICE}
Q3 = {"route": Q_CHOICE, "urgency": Q_SCORE, "refund": Q_NOUL}


def text(rng: random.Random, n: int) -> str:
    """An e-mail-like text of n words."""
    return "Subject: order %d\n" % rng.randint(1000, 9999) + " ".join(rng.choice(WORDS) for _ in range(n))


def log(msg: str) -> None:
    """Progress to stderr (the table goes to stdout last)."""
    print("[%7.1fs] %s" % (time.perf_counter() - T0, msg), file=sys.stderr, flush=True)


T0 = time.perf_counter()
DEVICE = "cuda"


class Budget:
    """A wall-clock budget for the whole run; sections check `left()` before starting."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        """Seconds remaining."""
        return self.end - time.perf_counter()


def timed(fn, warm: int = 3, iters: int = 20, max_s: float = 8.0) -> dict:
    """Median / p90 wall milliseconds of fn() (which must return host data, i.e. synchronise)."""
    for _ in range(warm):
        fn()
    ts = []
    t_end = time.perf_counter() + max_s
    while len(ts) < iters and (len(ts) < 3 or time.perf_counter() < t_end):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return {"ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))], "n": len(ts)}


def bench_gpu(fn, reps: int = 30) -> float:
    """Median milliseconds of a GPU callable (CUDA events, after warm-up)."""
    import torch

    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        pass
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


# -- sections ------------------------------------------------------------------------------------
def check_and_time(k, name: str, a, w, out, ref, flops: float) -> dict:
    """One GEMM kernel (GeGLU's signature for wi_geglu) on a NaN-filled output: its error against `ref` relative to
    ref's norm, and its GPU time."""
    import torch

    zb = torch.zeros(w.shape[0] // 2 if name == "wi_geglu" else w.shape[0], device=a.device)
    call = (lambda: k(a, w, out)) if name == "wi_geglu" else (lambda: k(a, w, zb, out))
    out.fill_(float("nan"))
    call()
    err = float((out.float() - ref.float()).norm()) / float(ref.float().norm())
    t = bench_gpu(call)
    return {"ms": t, "tflops": flops / t / 1e9, "rel_err": err}


def check_and_time_rope(kr, a, w, out, pos, cos, sin, ref_rope) -> dict:
    """A Wqkv kernel with its RoPE epilogue: error against the rotated reference, and its GPU time."""
    import torch

    zb = torch.zeros(w.shape[0], device=a.device)
    out.fill_(float("nan"))
    kr(a, w, zb, out, pos, cos, sin)
    return {"rope_rel_err": float((out.float() - ref_rope).norm() / ref_rope.norm()),
            "rope_ms": bench_gpu(lambda: kr(a, w, zb, out, pos, cos, sin))}


def section_gemm(res: dict, dims: dict, M: int) -> None:
    """Each GEMM shape: torch.matmul vs every TileLang candidate at M rows; picks winners; GEMM floor."""
    from dataclasses import replace

    import torch

    from bench.fastpath_sweep import GEMM_WS, SWEEP_GEGLU, SWEEP_GEMM, gemm_shapes
    from kernels import _tl
    from kernels import geglu as G
    from kernels import gemm as K
    from kernels import gemm_manual as GM
    from kernels.tuning import pick_gemm_ws
    from model.backends.fast.forward import sm_count

    d, inter, ffn, L, HL = dims["d"], dims["inter"], dims["ffn"], dims["layers"], dims["head_layers"]
    dev = "cuda"
    plain_total: dict[str, list] = {}   # manual plain config tag -> [config, ms over Wqkv (+RoPE), Wo, MLP Wo, shapes]
    a_full = torch.randn(M, max(d, inter, ffn), device=dev).bfloat16()
    rows = []
    for name, N, Kd in gemm_shapes(d, inter, ffn):
        a = a_full[:, :Kd].contiguous()
        n_t = 2 * N if name == "wi_geglu" else N
        w = (torch.randn(n_t, Kd, device=dev) * Kd ** -0.5).bfloat16()
        flops = 2.0 * M * n_t * Kd
        t_torch = bench_gpu(lambda a=a, w=w: torch.matmul(a, w.t()))
        # reference for every row (a persistent or tail tile that is wrong only far from row 0 shows):
        # torch's bf16 matmul, and for GeGLU its fp32 activation of that
        ref = torch.matmul(a, w.t())
        if name == "wi_geglu":
            ref = (torch.nn.functional.gelu(ref[:, :N].float()) * ref[:, N:].float()).bfloat16()
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        cands = []
        if name == "wqkv":   # the forward runs Wqkv with its RoPE epilogue: timed too, and that picks its tile
            from kernels import rope as RP

            pos = torch.randint(0, 512, (M,), device=dev, dtype=torch.int32)
            cos, sin = RP.rope_tables(160000.0, 512, dev)
            ref_rope = RP.rope_ref(ref, pos, cos, sin, d // 64).float()
        for cfg in (SWEEP_GEGLU if name == "wi_geglu" else SWEEP_GEMM):
            try:
                k = G.geglu_kernel(N, Kd, cfg) if name == "wi_geglu" else K.gemm_kernel(N, Kd, False, "none", cfg)
                cands.append({"cfg": cfg.tag(), **check_and_time(k, name, a, w, out, ref, flops), "_cfg": cfg})
                if name == "wqkv" and cfg.bn % 64 == 0:
                    cands[-1].update(check_and_time_rope(K.gemm_kernel(N, Kd, False, "none", cfg, rope_cols=2 * d),
                                                         a, w, out, pos, cos, sin, ref_rope))
            except Exception as e:  # a config that does not compile or run is reported, not fatal
                cands.append({"cfg": cfg.tag(), "error": "%s: %s" % (type(e).__name__, e)})
        ws = pick_gemm_ws(M, N, torch.bfloat16, torch.bfloat16, name == "wi_geglu", Kd, arch=_tl.target()["arch"],
                          sms=sm_count(), table=proposal())
        # what the forward runs on Hopper for this many rows (kernels/gemm_manual.py), then the form's default and its
        # alternatives (each once: every plain config is timed on every plain product)
        alts = [] if ws is None else [ws] + [replace(c, persistent=ws.persistent) for c in
                                             ((GM.GEGLU if name == "wi_geglu" else GM.GEMM),)
                                             + GEMM_WS[name == "wi_geglu"]]
        for alt in list({c.tag(): c for c in alts}.values()):
            tag = "ws:" + alt.tag()
            try:
                k = GM.gemm_manual_kernel(N, Kd, alt, geglu=name == "wi_geglu")
                cands.append({"cfg": tag, **check_and_time(k, name, a, w, out, ref, flops), "manual": True,
                              "_ws": alt})
                if name == "wqkv":
                    cands[-1].update(check_and_time_rope(GM.gemm_manual_kernel(N, Kd, alt, rope_cols=2 * d),
                                                         a, w, out, pos, cos, sin, ref_rope))
            except Exception as e:
                cands.append({"cfg": tag, "error": "%s: %s" % (type(e).__name__, e), "manual": True})
        ok = [c for c in cands if "ms" in c and c["rel_err"] < 2e-2]
        best = min(ok, key=lambda c: c["ms"]) if ok else None
        manual = [c for c in ok if c.get("manual")]
        ok = [c for c in ok if not c.get("manual")]   # the gemm / geglu tables hold the auto-specialised tiles
        ok_rope = [c for c in ok if c.get("rope_rel_err", 1.0) < 2e-2]
        use = min(ok_rope, key=lambda c: c["rope_ms"]) if ok_rope else min(ok, key=lambda c: c["ms"]) if ok else None
        if use is not None:
            propose("geglu" if name == "wi_geglu" else "gemm", "%dx%d" % (N, Kd), use["_cfg"])
        # the fastest manual config is what the forward (engines built after this section) runs: per product (Wqkv by
        # its time with the RoPE epilogue); the plain config summed fastest over the encoder's products serves any
        # plain product not timed here
        chosen = use
        if manual and name == "wi_geglu":
            chosen = min(manual, key=lambda c: c["ms"])
            propose("gemm_ws", "geglu", chosen["_ws"])
        elif manual:
            timed = [c for c in manual if name != "wqkv" or "rope_ms" in c] or manual
            chosen = min(timed, key=lambda c: c.get("rope_ms", c["ms"]) if name == "wqkv" else c["ms"])
            propose("gemm_ws", "gemm:%dx%d" % (N, Kd), chosen["_ws"])
            for c in manual:
                if name in ("wqkv", "wo", "wo_mlp") and ("rope_ms" in c or name != "wqkv"):
                    plain_total.setdefault(c["cfg"], [c["_ws"], 0.0, 0])
                    plain_total[c["cfg"]][1] += c.get("rope_ms", c["ms"])
                    plain_total[c["cfg"]][2] += 1
        for c in cands:
            c.pop("_cfg", None)
            c.pop("_ws", None)
        rows.append({"name": name, "M": M, "N": n_t, "K": Kd, "torch_ms": t_torch,
                     "torch_tflops": flops / t_torch / 1e9,
                     "candidates": cands, "best": best and best["cfg"],
                     "best_tflops": best and best["tflops"], "ratio_vs_torch": best and t_torch / best["ms"],
                     "used": chosen and chosen["cfg"],
                     **({"used_rope_ms": chosen["rope_ms"]} if chosen and "rope_ms" in chosen else {})})
        log("gemm %-9s torch %.0f TF/s, best tilelang %s" % (name, flops / t_torch / 1e9,
                                                             best and "%.0f TF/s (%s)" % (best["tflops"], best["cfg"])))
    full = [v for v in plain_total.values() if v[2] == 3]
    if len(full) > 1:
        propose("gemm_ws", "gemm", min(full, key=lambda v: v[1])[0])
    # GEMM floor: every matmul of encoder + head + scorer at torch.matmul speed, per token at this M
    counts = {"wqkv": L, "wo": L, "wi_geglu": L, "wo_mlp": L, "head_ffn1": HL, "head_ffn2": HL}
    floor_ms = sum(r["torch_ms"] * counts[r["name"]] for r in rows)
    head_extra = [(3 * d, d, HL), (d, d, HL + 1)]   # head in_proj / out_proj, scorer dense
    for N, Kd, c in head_extra:
        a = a_full[:, :Kd].contiguous()
        w = torch.randn(N, Kd, device=dev).bfloat16()
        floor_ms += c * bench_gpu(lambda a=a, w=w: torch.matmul(a, w.t()))
    res["gemm"] = {"M": M, "shapes": rows, "floor_ms": floor_ms, "floor_tok_s": M / floor_ms * 1e3,
                   "tuned": {k: v.tag() for k, v in {**proposal().gemm, **proposal().geglu}.items()}}
    log("GEMM floor at M=%d: %.2f ms -> %.0f tok/s" % (M, floor_ms, M / floor_ms * 1e3))


def section_attention(res: dict, heads: int, layers: int, global_every: int = 3, head_layers: int = 2,
                      skip: tuple = ()):
    """Every attention candidate: checked against the reference (padding tiles and empty rows included),
    then timed on ~64k packed tokens of offline-like rows; returns the fastest valid config.

    The candidates run in a child process (`--attention-child`), so one that faults the GPU or hangs costs
    its own row, not the benchmark: a child that dies is restarted after the candidate it was on."""
    from bench.fastpath_sweep import ATTENTION

    by_tag = {c.tag(): c for c in ATTENTION if c.tag() not in skip}
    todo, got = list(by_tag), {}
    while todo:
        cmd = [sys.executable, os.path.abspath(__file__), "--attention-child", ",".join(todo),
               "--heads", str(heads), "--layers", str(layers)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60 + 40 * len(todo), cwd=ROOT)
            out, err, rc = r.stdout, r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = "timeout", -9
        for line in out.splitlines():
            if line.startswith("ATTN "):
                rec = json.loads(line[5:])
                got[rec["cfg"]] = rec
                log("attention %s: %s" % (rec["cfg"], {k: round(v, 4) if isinstance(v, float) else v
                                                       for k, v in rec.items()}))
        left = [t for t in todo if t not in got]
        if left and rc != 0:
            got[left[0]] = {"cfg": left[0], "error": "child died (rc %s): %s" % (rc, err[-800:])}
            log("attention %s killed its child process (rc %s)" % (left[0], rc))
        elif left:
            for t in left:
                got[t] = {"cfg": t, "error": "not reported"}
        todo = [t for t in todo if t not in got]
    rows = [got[t] for t in by_tag]
    ok = [r for r in rows if "ms_per_forward" in r and r["rel_err"] < 2e-2]
    best = min(ok, key=lambda r: r["ms_per_forward"])["cfg"] if ok else None
    res["attention"] = {"candidates": rows, "best": best}
    return by_tag[best] if best else None


def section_add_ln(res: dict, d: int, M: int) -> None:
    """add+LayerNorm ("add" mode, the encoder's) per candidate config at M rows: checked against the reference on
    every row, timed, bandwidth (12 bytes per element: X read and written fp32, R read and Y written bf16); the
    fastest correct one goes to this run's proposed tuning table for the engines built after it."""
    import torch

    from bench.fastpath_sweep import SWEEP_LN
    from kernels import layernorm as L

    dev = "cuda"
    x0 = torch.randn(M, d, device=dev) * 30
    r = (torch.randn(M, d, device=dev) * 5).bfloat16()
    w = torch.rand(d, device=dev) + 0.5
    xr, yr = L.add_ln_ref(x0, r, w, None, 1e-5, "add")
    rows = []
    for cfg in SWEEP_LN:
        rec = {"cfg": cfg.tag()}
        try:
            k = L.add_ln_kernel(d, "add", False, 1e-5, torch.bfloat16, cfg)
            x = x0.clone()
            y = torch.full((M, d), float("nan"), device=dev, dtype=torch.bfloat16)
            k(x, r, w, w, y)
            rec["rel_err"] = max(float((x - xr).norm() / xr.norm()),
                                 float((y.float() - yr.float()).norm() / yr.float().norm()))
            xs = x0.clone()
            ms = bench_gpu(lambda k=k, xs=xs, y=y: k(xs, r, w, w, y))   # X grows each call: fine for timing
            rec.update(ms=ms, tb_s=M * d * 12 / ms / 1e9, _cfg=cfg)
        except Exception as e:  # a config that does not compile or run is reported, not fatal
            rec["error"] = "%s: %s" % (type(e).__name__, e)
        rows.append(rec)
    ok = [c for c in rows if "ms" in c and c["rel_err"] < 1e-2]
    best = min(ok, key=lambda c: c["ms"]) if ok else None
    if best is not None:
        propose("add_ln", str(d), best["_cfg"])
    for c in rows:
        c.pop("_cfg", None)
    default = L.default_config(d).tag()
    res["add_ln"] = {"M": M, "d": d, "candidates": rows, "best": best and best["cfg"], "default": default}
    log("add_ln sweep at %d x %d: %s; best %s (default %s)" % (M, d, ", ".join(
        "%s %.3f ms %.2f TB/s" % (c["cfg"], c["ms"], c["tb_s"]) if "ms" in c else "%s failed" % c["cfg"]
        for c in rows), best and best["cfg"], default))


def attention_child(tags: list[str], heads: int, layers: int, global_every: int = 3, head_layers: int = 2) -> int:
    """Check and time the attention candidates `tags` in order, printing one `ATTN {json}` line each."""
    import torch

    from bench.fastpath_sweep import ATTENTION
    from kernels import attention as A
    from model.backends.fast import row_capacity

    by_tag = {c.tag(): c for c in ATTENTION}
    dev = "cuda"
    rng = np.random.default_rng(0)

    def packed(lengths, extra=0):
        total = int(sum(lengths))
        qkv = torch.randn(total + extra, 3 * heads * 64, device=dev).bfloat16()
        qkv[total:] = 0
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.cumsum(torch.tensor(lengths, device=dev), 0)
        return qkv, cu, total

    check_len = [1, 2, 63, 64, 65, 129, 512, 300, 7]
    qc, cuc, tc = packed(check_len, extra=40)
    lengths = []
    while sum(lengths) < 65536 - 512:
        lengths.append(int(rng.integers(60, 513)))
    qb, cub, tb = packed(lengths, extra=65536 - sum(lengths))
    qb[tb:] = 8 * torch.randn_like(qb[tb:])  # finite garbage past the last row: a key-mask leak shows
    refb = {w: A.attention_ref(qb, cub, heads, w)[:tb].float() for w in (0, 64)}
    n_full = (layers + global_every - 1) // global_every + head_layers
    n_local = layers - (layers + global_every - 1) // global_every
    for tag in tags:
        cfg = by_tag[tag]
        rec = {"cfg": tag, "tokens": tb, "rows": len(lengths)}
        try:
            cu_full = torch.cat([cuc, cuc[-1:].repeat(3)])
            cap = -(-(tc + 40) // cfg.bm) + row_capacity(tc + 40)
            tiles = torch.from_numpy(A.tile_table(check_len, cfg.bm, cap, empty_row=len(check_len))).to(dev)
            errs = []
            for w in (0, 64):
                out = torch.full((tc + 40, heads * 64), float("nan"), device=dev).bfloat16()
                A.attention(qc, cu_full, tiles, heads, w, out=out, cfg=cfg)
                ref = A.attention_ref(qc, cuc, heads, w)
                ok_pad = bool(torch.isnan(out[tc:].float()).all())
                errs.append(float((out[:tc].float() - ref[:tc].float()).norm() / ref[:tc].float().norm())
                            if ok_pad else float("inf"))
            rec["rel_err"] = max(errs)
            capb = -(-65536 // cfg.bm) + row_capacity(65536)
            cub_full = torch.cat([cub, cub[-1:].repeat(row_capacity(65536) + 1 - len(lengths))])
            tiles_b = torch.from_numpy(A.tile_table(lengths, cfg.bm, capb, empty_row=len(lengths) + 1)).to(dev)
            outb = torch.zeros(65536, heads * 64, device=dev).bfloat16()
            for w in (0, 64):
                rec["ms_w%d" % w] = bench_gpu(lambda w=w, cfg=cfg, c=cub_full, t=tiles_b, o=outb: A.attention(
                    qb, c, t, heads, w, out=o, cfg=cfg))
                # the timed shape checked too (many rows, 64k tokens, right after back-to-back launches), and
                # twice more: a race shows as outputs that differ between identical calls
                outs = []
                for _ in range(2):
                    o = torch.full((65536, heads * 64), float("nan"), device=dev).bfloat16()
                    A.attention(qb, cub_full, tiles_b, heads, w, out=o, cfg=cfg)
                    outs.append(o[:tb].float())
                nan = bool(torch.isnan(outs[0]).any())
                err = float((outs[0] - refb[w]).norm() / refb[w].norm()) if not nan else float("inf")
                rec["rel_err"] = max(rec["rel_err"], err)
                rec["deterministic"] = rec.get("deterministic", True) and bool(torch.equal(outs[0], outs[1]))
            if not rec["deterministic"]:
                rec["rel_err"] = float("inf")
            rec["ms_per_forward"] = n_full * rec["ms_w0"] + n_local * rec["ms_w64"]
            rec["flops_tflops_w0"] = A.attention_flops(lengths, heads, 0) / rec["ms_w0"] / 1e9
        except Exception as e:
            rec["error"] = "%s: %s" % (type(e).__name__, e)
        print("ATTN " + json.dumps(rec), flush=True)
    return 0


def make_engines(ckpt: str, which: list[str], max_tokens: int, device: str = "cuda", attn_cfg=None) -> dict:
    """Our engines by name: fast (TileLang, bf16), fast16 (TileLang, fp16), eager (bf16 autocast), fp32 (eager
    fp32, TF32 off).

    On a CPU (a dry run of this script) `fast` runs its torch ops instead of the kernels."""
    import torch

    import model

    out = {}
    for name in which:
        t = time.perf_counter()
        if name in ("fast", "fast16"):
            extra = {"ops": "torch"} if device == "cpu" else {"tuning": proposal()}
            if attn_cfg is not None:
                extra["attn_cfg"] = attn_cfg
            if name == "fast16":
                extra["act_dtype"] = torch.float16
            eng = model.load(ckpt, device=device, backend="fast", max_batch_tokens=max_tokens, **extra)
            w = eng.warmup(max_tokens)
            out[name] = (eng, {"load_s": time.perf_counter() - t - w, "warmup_s": w,
                               "stats": eng.backend.stats.as_dict()})
        elif name == "eager":
            eng = model.load(ckpt, device=device, backend="eager")
            out[name] = (eng, {"load_s": time.perf_counter() - t})
        elif name == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            eng = model.load(ckpt, device=device, backend="eager", dtype=torch.float32)
            out[name] = (eng, {"load_s": time.perf_counter() - t})
        log("loaded %s in %.1fs" % (name, time.perf_counter() - t))
    return out


def rows_of(eng, cases) -> tuple[list, list]:
    """All rows of (states, questions) cases, and each row's case index."""
    rows, owner = [], []
    for ci, (states, qs) in enumerate(cases):
        prep = eng.prepare(qs)
        for enc in eng.encode_many(states, prep):
            rows += enc.rows
            owner += [ci] * len(enc.rows)
    return rows, owner


def probs(logits: np.ndarray, rows) -> list[np.ndarray]:
    """Per-row option probabilities (softmax over the row's own markers)."""
    out = []
    for lg, r in zip(logits, rows):
        z = lg[:len(r.markers)].astype(np.float64)
        e = np.exp(z - z.max())
        out.append(e / e.sum())
    return out


def forward_batched(eng, rows, budget: int = 32768) -> tuple[np.ndarray, np.ndarray]:
    """Backend forward over rows in token-budget micro-batches (padded cost for padded backends)."""
    from serve_app.scorer import plan

    packed = bool(getattr(eng.backend, "packed", False))
    K = max(len(r.markers) for r in rows)
    logits = np.full((len(rows), K), -1e4, np.float32)
    p0 = np.zeros(len(rows), np.float32)
    for idx in plan([len(r) for r in rows], budget, packed):
        lg, p = eng.backend.forward([rows[i] for i in idx])
        logits[idx, :lg.shape[1]] = lg
        p0[idx] = p
    return logits, p0


def section_numerics(res: dict, engines: dict, n_cases: int, ckpt: str | None = None) -> None:
    """fast and eager bf16 against fp32 eager on n_cases generated cases: max |dp|, argmax agreement."""
    from tests.cases import cases

    cs = cases(n_cases)
    eng = engines["fp32"][0]
    rows, _ = rows_of(eng, cs)
    out = {"cases": n_cases, "rows": len(rows), "tokens": sum(len(r) for r in rows)}
    ref_l, ref_p = forward_batched(eng, rows)
    ref = probs(ref_l, rows)
    for name in ("eager", "fast", "fast16"):
        if name not in engines:
            continue
        lg, p0 = forward_batched(engines[name][0], rows)
        pr = probs(lg, rows)
        dp = max(float(np.abs(a - b).max()) for a, b in zip(pr, ref))
        agree = float(np.mean([a.argmax() == b.argmax() for a, b in zip(pr, ref)]))
        out[name] = {"max_dp": dp, "argmax_agree": agree, "nan": bool(np.isnan(lg).any() or np.isnan(p0).any()),
                     "max_dp_act": float(np.abs(p0 - ref_p).max()),
                     "mean_dp": float(np.mean([np.abs(a - b).max() for a, b in zip(pr, ref)]))}
        log("numerics %s: max|dp| %.4f, argmax %.4f, act %.4f" % (name, dp, agree, out[name]["max_dp_act"]))
    res["numerics"] = out
    if ckpt:
        numerics_sources(out, ckpt, rows, ref)


def numerics_sources(out: dict, ckpt: str, rows, ref) -> None:
    """Where the bf16 error comes from, on the same rows: fp32 eager with only the weights rounded to bf16
    (the rest fp32), and eager under fp16 autocast (3 more mantissa bits than bf16, same tensor-core speed)."""
    import torch

    import model

    def weights_bf16(eng):
        for p in eng.backend.model.parameters():
            p.data = p.data.bfloat16().float()
        return eng

    variants = {"fp32_bf16_weights": lambda: weights_bf16(model.load(ckpt, device=DEVICE, backend="eager",
                                                                     dtype=torch.float32)),
                "eager_fp16": lambda: model.load(ckpt, device=DEVICE, backend="eager", dtype=torch.float16)}
    for name, make in variants.items():
        try:
            eng = make()
            lg, p0 = forward_batched(eng, rows)
            pr = probs(lg, rows)
            out[name] = {"max_dp": max(float(np.abs(a - b).max()) for a, b in zip(pr, ref)),
                         "argmax_agree": float(np.mean([a.argmax() == b.argmax() for a, b in zip(pr, ref)])),
                         "nan": bool(np.isnan(lg).any())}
            log("numerics %s: max|dp| %.4f, argmax %.4f" % (name, out[name]["max_dp"], out[name]["argmax_agree"]))
        except Exception as e:  # a diagnostic only
            out[name] = {"error": "%s: %s" % (type(e).__name__, e)}
        eng = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def short_words(eng, target: int = 72) -> int:
    """How many words make the 1-question row closest to `target` tokens with this tokenizer."""
    best, best_err = 20, 1 << 30
    for n in range(4, 80, 2):
        rows, _ = rows_of(eng, [([text(random.Random(0), n)], Q1)])
        err = abs(len(rows[0]) - target)
        if err < best_err:
            best, best_err = n, err
    return best


def workloads(seed: int = 0, offline_states: int = 2048, short: int = 34) -> dict:
    """The benchmark workloads: (states, questions) per name."""
    rng = random.Random(seed)
    s1 = text(random.Random(0), short)
    w = {"1x1": ([s1], Q1), "1x3": ([s1], Q3),
         "10x3@512": ([text(rng, 700) for _ in range(10)], Q3)}
    w["offline"] = ([text(rng, rng.randint(30, 420)) for _ in range(offline_states)], Q3)
    return w


def section_latency(res: dict, engines: dict, wl: dict) -> None:
    """Our engines on the latency workloads: end-to-end predict/predict_batch and forward only."""
    out = res.setdefault("latency", {})
    for name in ("fast", "fast16", "eager"):
        if name not in engines:
            continue
        eng = engines[name][0]
        for wname in ("1x1", "1x3", "10x3@512"):
            states, qs = wl[wname]
            rows, _ = rows_of(eng, [(states, qs)])
            tok = sum(len(r) for r in rows)
            if len(states) == 1:
                e2e = timed(lambda eng=eng, s=states[0], qs=qs: eng.predict(s, qs))
            else:
                e2e = timed(lambda eng=eng, s=states, qs=qs: eng.predict_batch(s, qs))
            fwd = timed(lambda eng=eng, rows=rows: eng.backend.forward(rows))
            enc = timed(lambda eng=eng, states=states, qs=qs: eng.encode_many(states, eng.prepare(qs)))
            out.setdefault(wname, {})["ours_" + name] = {"e2e_ms": e2e["ms"], "e2e_p90_ms": e2e["p90_ms"],
                                                         "fwd_ms": fwd["ms"], "encode_ms": enc["ms"], "tokens": tok,
                                                         "rows": len(rows)}
            log("%s %s: e2e %.2f ms, fwd %.2f ms (%d tokens)" % (name, wname, e2e["ms"], fwd["ms"], tok))


def encode_probe(res: dict, engines: dict, wl: dict, when: str) -> None:
    """How long the fast engine takes to tokenise the 10 x 3 @ 512 states at this point of the run (`encode_many`,
    and the Rust tokenizer's batch call alone on the same 10 texts), and how many objects the garbage collector
    tracks: the same call runs slower late in this benchmark than in a clean process, so each section's effect is
    recorded."""
    import gc
    import threading

    from model.questions import serialize_state

    if "fast" not in engines:
        return
    eng = engines["fast"][0]
    states, qs = wl["10x3@512"]
    prep = eng.prepare(qs)
    b = eng.builder
    texts = [b._clean(serialize_state(s)) for s in states]
    rec = {"encode_ms": timed(lambda: eng.encode_many(states, prep))["ms"],
           "tokenizer_ms": timed(lambda: b._batch(texts))["ms"],
           "gc_objects": len(gc.get_objects()), "threads": threading.active_count()}
    res.setdefault("encode_probe", {})[when] = rec
    log("encode probe %s: %s" % (when, rec))


def section_profile(res: dict, engines: dict, wl: dict) -> None:
    """GPU time per op kind of one fast forward (and fast16's): the 10x3@512 batch and a ~64k-token offline
    chunk."""
    out = {}
    for name in ("fast", "fast16"):
        if name not in engines:
            continue
        eng = engines[name][0]
        ff = eng.backend.engine
        sfx = "" if name == "fast" else " " + name
        rows, _ = rows_of(eng, [wl["10x3@512"]])
        out["10x3@512" + sfx] = ff.profile(rows)
        out["10x3@512" + sfx]["split"] = forward_split(eng, rows)
        orows, _ = rows_of(eng, [(wl["offline"][0][:400], wl["offline"][1])])
        chunk, tot = [], 0
        for r in orows:
            if tot + len(r) > ff.T_max:
                break
            chunk.append(r)
            tot += len(r)
        out["offline_chunk" + sfx] = ff.profile(chunk)
        if name == "fast":   # the chunk's graph unprofiled (the profile's events add a few us a kernel)
            out["offline_chunk"]["split"] = forward_split(eng, chunk, reps=8)
    res["profile"] = out
    for k, p in out.items():
        groups = group_ops(p["ops"])
        log("profile %s (%d tokens, bucket %d): total %.2f ms; %s; other %.2f" % (
            k, p["tokens"], p["bucket"], p["total_ms"], ", ".join("%s %.2f" % kv for kv in groups.items()),
            p["other_ms"]))


def forward_split(eng, rows, reps: int = 20) -> dict:
    """Where one fast forward of `rows` (one chunk) spends its time, medians in ms: the host staging, the
    encoder graph's replay on the GPU (CUDA events), and the whole backend forward (wall clock, synchronised)."""
    import torch

    ff = eng.backend.engine
    Tb = ff.bucket_for(sum(len(r.ids) for r in rows), len(rows))
    stage, graph, whole = [], [], []
    with ff._lock:
        for _ in range(reps):
            t = time.perf_counter()
            _, gb = ff._stage(rows, Tb)
            stage.append((time.perf_counter() - t) * 1e3)
            n = ff._int_size(Tb)
            ff._ints[:n].copy_(ff._ints_host[:n])
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            ff._encoder(Tb, gb)
            e1.record()
            torch.cuda.synchronize()
            graph.append(e0.elapsed_time(e1))
    for _ in range(reps):
        t = time.perf_counter()
        eng.backend.forward(rows)
        whole.append((time.perf_counter() - t) * 1e3)
    return {"stage_ms": float(np.median(stage)), "graph_ms": float(np.median(graph)),
            "forward_ms": float(np.median(whole))}


def group_ops(ops: dict) -> dict:
    """Op-kind times summed into gemm / geglu / attention / add_ln / rope."""
    g: dict[str, float] = {}
    for k, v in ops.items():
        key = k.split(" ")[0]
        g[key] = g.get(key, 0.0) + v
    return g


def section_offline(res: dict, engines: dict, wl: dict, flops_tok: float, budget: Budget) -> None:
    """Offline throughput: forward-only over pre-encoded rows, and end-to-end predict_batch."""
    out = res.setdefault("offline", {})
    states, qs = wl["offline"]
    for name in ("fast", "fast16", "eager"):
        if name not in engines or budget.left() < 30:
            continue
        eng = engines[name][0]
        t = time.perf_counter()
        rows, _ = rows_of(eng, [(states, qs)])
        t_enc = time.perf_counter() - t
        tok = sum(len(r) for r in rows)
        bud = 65536 if name.startswith("fast") else 32768
        forward_batched(eng, rows[: min(len(rows), 256)], bud)  # warm
        t = time.perf_counter()
        forward_batched(eng, rows, bud)
        t_fwd = time.perf_counter() - t
        rec = {"states": len(states), "rows": len(rows), "tokens": tok, "encode_s": t_enc, "fwd_s": t_fwd,
               "fwd_tok_s": tok / t_fwd, "fwd_mfu": tok / t_fwd * flops_tok / PEAK_BF16}
        if getattr(eng.backend, "packed", False):
            # the same rows, length-sorted, in one backend call: the backend cuts its own chunks and stages chunk
            # k + 1 while the GPU runs chunk k (forward_batched's one call a chunk waits for each)
            srows = sorted(rows, key=len)
            t = time.perf_counter()
            eng.backend.forward(srows)
            t_one = time.perf_counter() - t
            rec.update(fwd_per_chunk_tok_s=rec["fwd_tok_s"], fwd_s=t_one, fwd_tok_s=tok / t_one,
                       fwd_mfu=tok / t_one * flops_tok / PEAK_BF16)
        if budget.left() > (40 if name.startswith("fast") else 150):
            t = time.perf_counter()
            eng.predict_batch(states, qs, batch_size=256 if name.startswith("fast") else 64, sort_by_length=True)
            t_e2e = time.perf_counter() - t
            rec.update(e2e_s=t_e2e, e2e_tok_s=tok / t_e2e)
        out["ours_" + name] = rec
        log("offline %s: %d tokens, fwd %.0f tok/s (MFU %.2f; one call a chunk %s), e2e %s" % (
            name, tok, rec["fwd_tok_s"], rec["fwd_mfu"], rec.get("fwd_per_chunk_tok_s") and
            "%.0f tok/s" % rec["fwd_per_chunk_tok_s"], rec.get("e2e_tok_s") and "%.0f tok/s" % rec["e2e_tok_s"]))
    if "ours_fast" in out and "gemm" in res:
        out["ours_fast"]["vs_gemm_floor"] = out["ours_fast"]["fwd_tok_s"] / res["gemm"]["floor_tok_s"]


def section_hf(res: dict, ckpt: str, device: str, budget: Budget, rows: int = 256, tokens: int = 256) -> None:
    """The issue's outside reference: transformers' ModernBertModel (encoder only, no head) with this checkpoint's
    encoder weights, bf16, SDPA, on full rows x tokens batches (no padding), eager and under torch.compile;
    tokens/s per batch and the compile time."""
    import torch
    from safetensors.torch import load_file
    from transformers import ModernBertModel

    from model.bundle import open_bundle

    cfg = open_bundle(ckpt).encoder_config
    cfg._attn_implementation = "sdpa"
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    enc = ModernBertModel(cfg)
    sd = {k[len("encoder."):]: v for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()
          if k.startswith("encoder.")}
    missing, unexpected = enc.load_state_dict(sd, strict=False)
    enc = enc.to(device=device, dtype=dt).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (rows, tokens), generator=g).to(device)
    att = torch.ones_like(ids)
    out = {"rows": rows, "tokens": tokens, "dtype": str(dt), "missing_keys": len(missing),
           "unexpected_keys": len(unexpected)}

    def timed(fn) -> float:
        if device == "cuda":
            return bench_gpu(fn)
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    with torch.no_grad():
        ms = timed(lambda: enc(input_ids=ids, attention_mask=att))
        out["eager_ms"], out["eager_tok_s"] = ms, rows * tokens / ms * 1e3
        log("transformers ModernBERT eager SDPA: %.2f ms per %dx%d batch, %.0f tok/s" % (ms, rows, tokens,
                                                                                        out["eager_tok_s"]))
        if budget.left() > 90:
            comp = torch.compile(enc)
            t = time.perf_counter()
            comp(input_ids=ids, attention_mask=att)
            if device == "cuda":
                torch.cuda.synchronize()
            out["compile_s"] = time.perf_counter() - t
            ms = timed(lambda: comp(input_ids=ids, attention_mask=att))
            out["compile_ms"], out["compile_tok_s"] = ms, rows * tokens / ms * 1e3
            log("transformers ModernBERT + torch.compile: %.2f ms per batch, %.0f tok/s (compile %.1f s)" % (
                ms, out["compile_tok_s"], out["compile_s"]))
    res["hf"] = out
    if device == "cuda":
        torch.cuda.empty_cache()


def section_upstream(res: dict, ckpt: str, wl: dict, tokens: int, budget: Budget, offline_states: int) -> None:
    """Upstream laya 0.4.15, eager and tilelang backends, on the same checkpoint."""
    import laya

    states_off, qs_off = wl["offline"]
    for backend in ("eager", "tilelang"):
        if budget.left() < 40:
            log("upstream %s skipped (budget)" % backend)
            continue
        key = "upstream_" + backend
        try:
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                agent = laya.load(ckpt, device=DEVICE, backend=backend)
            res.setdefault("load", {})[key] = {"load_s": time.perf_counter() - t, "backend": agent.backend}
            log("upstream %s loaded (%s) in %.1fs" % (backend, agent.backend, time.perf_counter() - t))
            for wname in ("1x1", "1x3", "10x3@512"):
                if budget.left() < 25:
                    break
                states, qs = wl[wname]
                if len(states) == 1:
                    r = timed(lambda ag=agent, s=states[0], qs=qs: ag.system_one(s, qs), iters=15)
                else:
                    r = timed(lambda ag=agent, s=states, qs=qs: ag.predict_batch(s, qs), iters=10)
                rec = {"e2e_ms": r["ms"], "e2e_p90_ms": r["p90_ms"]}
                res.setdefault("latency", {}).setdefault(wname, {})[key] = rec
                log("upstream %s %s: %.2f ms" % (backend, wname, r["ms"]))
            n = min(offline_states, len(states_off))
            if budget.left() > 60:
                sub = states_off[:n]
                tok = tokens
                agent.predict_batch(sub[:64], qs_off, batch_size=64, sort_by_length=True)
                t = time.perf_counter()
                agent.predict_batch(sub, qs_off, batch_size=64, sort_by_length=True)
                el = time.perf_counter() - t
                res.setdefault("offline", {})[key] = {"states": n, "tokens": tok, "e2e_s": el, "e2e_tok_s": tok / el}
                log("upstream %s offline: %.0f tok/s over %d states" % (backend, tok / el, n))
            agent = None  # free its GPU memory before the next backend
        except Exception as e:
            res.setdefault("errors", {})[key] = "%s: %s" % (type(e).__name__, e)
            log("upstream %s failed: %s" % (backend, traceback.format_exc()))


# -- report ---------------------------------------------------------------------------------------
def table(res: dict) -> str:
    """The side-by-side table as text."""
    lines = []
    lat = res.get("latency", {})
    systems = ["ours_fast", "ours_fast16", "ours_eager", "upstream_eager", "upstream_tilelang"]
    lines.append("%-10s %s" % ("workload", " ".join("%18s" % s for s in systems)))
    for w in ("1x1", "1x3", "10x3@512"):
        cells = []
        for s in systems:
            r = lat.get(w, {}).get(s)
            cells.append("%18s" % ("-" if not r else "%.2f ms" % r["e2e_ms"] +
                                   (" (f %.2f)" % r["fwd_ms"] if "fwd_ms" in r else "")))
        lines.append("%-10s %s" % (w, " ".join(cells)))
    off = res.get("offline", {})
    cells = []
    for s in systems:
        r = off.get(s)
        if not r:
            cells.append("%18s" % "-")
        elif "fwd_tok_s" in r:
            cells.append("%18s" % ("%.0fk f/%.0fk e" % (r["fwd_tok_s"] / 1e3, r.get("e2e_tok_s", 0) / 1e3)))
        else:
            cells.append("%18s" % ("%.0fk e" % (r["e2e_tok_s"] / 1e3)))
    lines.append("%-10s %s" % ("offline", " ".join(cells)))
    hf = res.get("hf")
    if hf:
        lines.append("transformers ModernBERT (encoder only) on full %dx%d batches: eager SDPA %.0fk tok/s%s" % (
            hf["rows"], hf["tokens"], hf["eager_tok_s"] / 1e3,
            ", torch.compile %.0fk tok/s (compile %.0f s)" % (hf["compile_tok_s"] / 1e3, hf["compile_s"])
            if "compile_tok_s" in hf else ""))
        fast = res.get("offline", {}).get("ours_fast")
        if fast and "compile_tok_s" in hf:
            lines.append("  ours fast offline / transformers + compile: %.2f"
                         % (fast["fwd_tok_s"] / hf["compile_tok_s"]))
    g = res.get("gemm")
    if g:
        lines.append("GEMM floor (M=%d): %.0fk tok/s" % (g["M"], g["floor_tok_s"] / 1e3))
        for r in g["shapes"]:
            lines.append("  %-9s N=%-5d K=%-5d torch %4.0f TF/s  tilelang %s" % (
                r["name"], r["N"], r["K"], r["torch_tflops"],
                "%4.0f TF/s (%.2f of torch, %s)" % (r["best_tflops"], r["ratio_vs_torch"], r["best"])
                if r["best"] else "n/a"))
            lines.append("            " + ", ".join(
                "%s %.0f" % (c["cfg"], c["tflops"]) + ("" if c["rel_err"] < 2e-2 else " (wrong: %.1e)" % c["rel_err"])
                + (" (+RoPE %.3f ms%s)" % (c["rope_ms"], "" if c["rope_rel_err"] < 2e-2 else " wrong")
                   if "rope_ms" in c else "")
                if "ms" in c else "%s failed" % c["cfg"] for c in r["candidates"]))
            if r.get("used") and r["used"] != r["best"]:
                lines.append("            the forward uses %s (%s)" % (r["used"], "kernels/gemm_manual.py"
                             if r["used"].startswith("ws:") else "fastest with its RoPE epilogue"))
    al = res.get("add_ln")
    if al:
        lines.append("add+LN (%d x %d, add mode): " % (al["M"], al["d"]) + ", ".join(
            "%s %.2f TB/s%s" % (c["cfg"], c["tb_s"], " (wrong)" if c["rel_err"] >= 1e-2 else "")
            if "ms" in c else "%s failed" % c["cfg"] for c in al["candidates"])
            + "; used %s (default %s)" % (al["best"], al["default"]))
    n = res.get("numerics")
    if n:
        for k in ("eager", "fast", "fast16"):
            if k in n:
                lines.append("numerics %-6s vs fp32 (%d rows): max|dp| %.4f  argmax %.3f  act %.4f  nan %s" % (
                    k, n["rows"], n[k]["max_dp"], n[k]["argmax_agree"], n[k]["max_dp_act"], n[k]["nan"]))
        for k in ("fp32_bf16_weights", "eager_fp16"):
            if "max_dp" in n.get(k, {}):
                lines.append("numerics %-17s vs fp32: max|dp| %.4f  argmax %.3f  (where the error comes from)" % (
                    k, n[k]["max_dp"], n[k]["argmax_agree"]))
    at = res.get("attention")
    if at:
        for c in at["candidates"]:
            if "ms_per_forward" in c:
                lines.append("  attention %-16s full %.3f ms, window %.3f ms (64k tokens), %.2f ms/forward, err %.1e%s"
                             % (c["cfg"], c["ms_w0"], c["ms_w64"], c["ms_per_forward"], c["rel_err"],
                                "  <- used" if c["cfg"] == at["best"] else ""))
            elif "error" in c:
                lines.append("  attention %-16s failed: %s" % (c["cfg"], c["error"].splitlines()[0][:90]))
    for k, p in res.get("profile", {}).items():
        lines.append("profile %-13s %5d tok: %.2f ms = %s, other %.2f" % (
            k, p["tokens"], p["total_ms"], ", ".join("%s %.2f" % kv for kv in group_ops(p["ops"]).items()),
            p["other_ms"]))
        if "split" in p:
            lines.append("  one forward %.2f ms: host staging %.2f, encoder graph on the GPU %.2f" % (
                p["split"]["forward_ms"], p["split"]["stage_ms"], p["split"]["graph_ms"]))
    fs = res.get("load", {}).get("fast", {}).get("stats")
    if fs:
        lines.append("fast: %d graphs + %d tail graphs, warm-up %.1fs, captures after warm-up %d" % (
            fs["graphs"], fs["tail_graphs"], res["load"]["fast"]["warmup_s"], fs["captures_after_warmup"]))
    return "\n".join(lines)


def plot(res: dict, path: str) -> bool:
    """Bar charts of latency and offline throughput; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    systems = ["ours_fast", "ours_fast16", "ours_eager", "upstream_eager", "upstream_tilelang"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    lat = res.get("latency", {})
    ws = ["1x1", "1x3", "10x3@512"]
    width = 0.16
    for i, s in enumerate(systems):
        vals = [lat.get(w, {}).get(s, {}).get("e2e_ms", 0) for w in ws]
        axes[0].bar([j + i * width for j in range(len(ws))], vals, width, label=s)
    axes[0].set_xticks([j + 2 * width for j in range(len(ws))], ws)
    axes[0].set_ylabel("ms (end to end, median)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[0].set_title("latency")
    off = res.get("offline", {})
    names, vals = [], []
    for s in systems:
        r = off.get(s)
        if r:
            names.append(s)
            vals.append(r.get("fwd_tok_s", r.get("e2e_tok_s", 0)) / 1e3)
    if "gemm" in res:
        names.append("GEMM floor")
        vals.append(res["gemm"]["floor_tok_s"] / 1e3)
    axes[1].bar(names, vals, color="tab:green")
    axes[1].set_ylabel("k tokens/s (forward; upstream end to end)")
    axes[1].set_title("offline throughput")
    axes[1].tick_params(axis="x", labelrotation=20)
    fig.suptitle("laya-fleet fast path, %s, %s" % (res.get("gpu", "?"), res.get("date", "")))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    """Run the benchmark; returns the exit status."""
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
                    help="sections to skip: gemm add_ln attention numerics latency profile offline hf upstream")
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
    sections = ("gemm", "add_ln", "attention", "numerics", "latency", "profile", "offline", "hf", "upstream")
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
    if any(x not in sections for x in a.skip):  # a misspelt section would silently run
        ap.error("--skip: unknown %s (use %s)" % (", ".join(x for x in a.skip if x not in sections),
                                                 ", ".join(sections)))
    if a.attention_child:
        return attention_child(a.attention_child.split(","), a.heads, a.layers)
    if a.plot:
        with open(a.plot) as fh:
            res = json.load(fh)
        png = a.plot[:-5] + ".png"
        print("wrote %s" % png if plot(res, png) else "matplotlib missing")
        return 0

    import torch

    global DEVICE
    DEVICE = a.device
    if a.device == "cpu":
        a.skip = list(a.skip) + ["gemm"]
    budget = Budget(a.budget_s)
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
        log("checkpoint %s in %.1fs" % (a.make, time.perf_counter() - t))
    from model.backends.fast import flops_per_token
    from model.bundle import open_bundle

    b = None
    if "gemm" not in a.skip:
        from model.make_checkpoint import SHAPES

        s = SHAPES[a.make or "modernbert-large"]
        dims = dict(d=s["hidden"], inter=s["ff"], ffn=4 * s["hidden"], layers=s["layers"], head_layers=2)
        try:
            section_gemm(res, dims, a.gemm_m)
        except Exception:
            res.setdefault("errors", {})["gemm"] = traceback.format_exc()
            log(traceback.format_exc())
        save()
    if "add_ln" not in a.skip and a.device == "cuda":
        from model.make_checkpoint import SHAPES

        try:
            section_add_ln(res, SHAPES[a.make or "modernbert-large"]["hidden"], a.gemm_m)
        except Exception:
            res.setdefault("errors", {})["add_ln"] = traceback.format_exc()
            log(traceback.format_exc())
        save()
    attn_cfg = None
    if "attention" not in a.skip:
        try:
            attn_cfg = section_attention(res, 16 if (a.make or "modernbert-large") == "modernbert-large" else 12,
                                         28 if (a.make or "modernbert-large") == "modernbert-large" else 22,
                                         skip=tuple(skip_attn))
        except Exception:
            res.setdefault("errors", {})["attention"] = traceback.format_exc()
            log(traceback.format_exc())
        save()
    t_wait = time.perf_counter() + a.wait_ckpt
    while not os.path.isfile(os.path.join(a.ckpt, "rl_agent_config.json")) and time.perf_counter() < t_wait:
        time.sleep(1)
    b = open_bundle(a.ckpt)
    ec = b.encoder_config
    flops_tok = flops_per_token(ec.hidden_size, ec.num_hidden_layers, ec.intermediate_size, 2, 4 * ec.hidden_size)
    res["flops_per_token"] = flops_tok
    engines = {}
    for name in ("fast", "fast16", "eager", "fp32"):
        try:
            engines.update(make_engines(a.ckpt, [name], a.max_batch_tokens, a.device, attn_cfg))
            res.setdefault("load", {})[name] = engines[name][1]
        except Exception:
            res.setdefault("errors", {})["load_" + name] = traceback.format_exc()
            log(traceback.format_exc())
    save()
    short = short_words(next(iter(engines.values()))[0]) if engines else 34
    wl = workloads(offline_states=a.offline_states, short=short)
    encode_probe(res, engines, wl, "after_load")
    sections = [("numerics", lambda: section_numerics(res, engines, a.cases, a.ckpt)),
                ("probe", lambda: encode_probe(res, engines, wl, "after_numerics")),
                ("latency", lambda: section_latency(res, engines, wl)),
                ("profile", lambda: section_profile(res, engines, wl)),
                ("offline", lambda: section_offline(res, engines, wl, flops_tok, budget)),
                ("probe", lambda: encode_probe(res, engines, wl, "after_offline")),
                ("hf", lambda: section_hf(res, a.ckpt, a.device, budget))]
    for name, fn in sections:
        if name in a.skip or budget.left() < 20:
            log("section %s skipped" % name)
            continue
        try:
            fn()
        except Exception:
            res.setdefault("errors", {})[name] = traceback.format_exc()
            log(traceback.format_exc())
        save()
    if "fast" in engines:
        res["load"]["fast"]["stats"] = engines["fast"][0].backend.stats.as_dict()
    n_up = min(a.upstream_offline_states, a.offline_states)
    any_eng = next(iter(engines.values()))[0] if engines else None
    up_tokens = sum(len(r) for r in rows_of(any_eng, [(wl["offline"][0][:n_up], wl["offline"][1])])[0]) \
        if any_eng else 0
    engines.clear()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    if "upstream" not in a.skip:
        try:
            section_upstream(res, a.ckpt, wl, up_tokens, budget, n_up)
        except Exception:
            res.setdefault("errors", {})["upstream"] = traceback.format_exc()
    res["elapsed_s"] = time.perf_counter() - T0
    save()
    png = out_json[:-5] + ".png"
    res["png"] = png if plot(res, png) else None
    save()
    print(table(res))
    res["tuning"] = proposal().as_dict()
    print("proposed kernels/tuning.json:\n%s" % json.dumps(res["tuning"], indent=1))
    if a.tuning_out:
        with open(a.tuning_out, "w") as fh:
            json.dump(res["tuning"], fh, indent=1)
            fh.write("\n")
        print("wrote %s (copy it over kernels/tuning.json to make the forward run it)" % a.tuning_out)
    save()
    if res.get("errors"):
        print("errors in: %s" % ", ".join(res["errors"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
