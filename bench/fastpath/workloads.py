"""The benchmark's inputs: generated e-mail states and questions, the workloads built from them, the engines
under test, and how rows go through an engine (encode, batched forward, probabilities)."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import numpy as np

from bench.fastpath.common import log, proposal

# our fast engines: bf16, fp16, the FP8 precision, bf16 / fp16 with the add+LayerNorm fold from FOLD_M tokens, and
# bf16 and FP8 with ping-pong consumers in every hand-warp-specialised GEMM (bf16 without and with the fold)
FAST = ("fast", "fast16", "fast8", "fold", "fold16", "pingpong", "foldpp", "fast8pp")
PINGPONG = ("pingpong", "foldpp", "fast8pp")
FOLD_M = 1024

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


def pingpong_table(table, d: int, inter: int, ffn: int, sms: int = 132):
    """`table` with every hand-warp-specialised product of a model of this shape (width d, GeGLU width inter, head
    FFN width ffn), with 16-bit and with e4m3 operands, run with ping-pong consumers (kernels/gemm_manual.py's
    `pingpong`, one wgmma batch in flight), each product's entry keyed as kernels/tuning.py's pick_gemm_ws /
    pick_gemm_ws8 read it and otherwise the config they pick."""
    from model.backends.fast import fp8
    from model.backends.fast.specs import kernel_specs

    out = table
    specs = kernel_specs(d, max(1, d // 64), inter, ffn, {0}, table=table, arch="sm_90a", sms=sms)
    for kind, args in specs + fp8.kernel_specs(d, inter, arch="sm_90a", sms=sms, table=table):
        if kind == "gemm_ws":
            N, K, cfg, geglu, e4m3 = args[0], args[1], args[2], args[6], len(args) > 8 and args[8]
            out = out.with_entry("gemm_ws", "%s%s:%dx%d" % ("geglu" if geglu else "gemm", "8" if e4m3 else "", N, K),
                                 replace(cfg, inflight=1, pingpong=True))
    return out


def ckpt_dims(ckpt: str) -> dict:
    """(d, inter, ffn) of a Laya checkpoint directory: its encoder's config.json, the head FFN 4 d wide as
    make-checkpoint's (a head of another width keeps the shipped configs in `pingpong_table`)."""
    import json
    import os

    with open(os.path.join(ckpt, "encoder", "config.json"), encoding="utf-8") as fh:
        c = json.load(fh)
    return {"d": int(c["hidden_size"]), "inter": int(c["intermediate_size"]), "ffn": 4 * int(c["hidden_size"])}


def make_engines(ckpt: str, which: list[str], max_tokens: int, device: str = "cuda", attn_cfg=None) -> dict:
    """Our engines by name: fast (TileLang, bf16), fast16 (TileLang, fp16), fast8 (the FP8 precision: e4m3 encoder
    GEMMs, the rest bf16), fold / fold16 (fast / fast16 with the tuning table's ln_fold_m at FOLD_M: the
    add+LayerNorm folded into the GEMMs from that bucket up), pingpong / foldpp / fast8pp (fast / fold / fast8 with
    `pingpong_table`), eager (bf16 autocast), fp32 (eager fp32, TF32 off).

    On a CPU (a dry run of this script) `fast` runs its torch ops instead of the kernels."""
    import torch

    import model

    out = {}
    for name in which:
        t = time.perf_counter()
        if name in FAST:
            table = proposal()
            if name.startswith("fold"):
                table = replace(table, ln_fold_m=max(FOLD_M, table.small_m + 64))   # foldpp too
            if name in PINGPONG:
                from model.backends.fast.specs import sm_count

                table = pingpong_table(table, **ckpt_dims(ckpt), sms=sm_count())
            extra = {"tuning": table, **({"ops": "torch"} if device == "cpu" else {})}
            if attn_cfg is not None:
                extra["attn_cfg"] = attn_cfg
            if name in ("fast16", "fold16"):
                extra["act_dtype"] = torch.float16
            if name in ("fast8", "fast8pp"):
                extra["fp8"] = True
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
    from serve_app.planning import plan

    packed = bool(getattr(eng.backend, "packed", False))
    K = max(len(r.markers) for r in rows)
    logits = np.full((len(rows), K), -1e4, np.float32)
    p0 = np.zeros(len(rows), np.float32)
    for idx in plan([len(r) for r in rows], budget, packed):
        lg, p = eng.backend.forward([rows[i] for i in idx])
        logits[idx, :lg.shape[1]] = lg
        p0[idx] = p
    return logits, p0


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
