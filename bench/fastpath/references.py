"""The outside references on the same checkpoint: transformers' ModernBERT encoder (eager and torch.compile) and
upstream laya 0.4.15 (eager and tilelang backends)."""

from __future__ import annotations

import os
import time
import traceback
import warnings

from bench.fastpath import common
from bench.fastpath.common import Budget, bench_gpu, log, timed


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
                agent = laya.load(ckpt, device=common.DEVICE, backend=backend)
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
