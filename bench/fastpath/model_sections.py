"""The sections that run our engines: numerics against fp32, latency per workload, the tokenizer probe, the
per-op GPU profile and offline throughput."""

from __future__ import annotations

import time

import numpy as np

from bench.fastpath import common
from bench.fastpath.common import PEAK_BF16, Budget, log, timed
from bench.fastpath.workloads import FAST, forward_batched, probs, rows_of


def section_numerics(res: dict, engines: dict, n_cases: int, ckpt: str | None = None) -> None:
    """fast (bf16, fp16, fp8) and eager bf16 against fp32 eager on n_cases generated cases: max |dp|, argmax
    agreement."""
    from tests.cases import cases

    cs = cases(n_cases)
    eng = engines["fp32"][0]
    rows, _ = rows_of(eng, cs)
    out = {"cases": n_cases, "rows": len(rows), "tokens": sum(len(r) for r in rows)}
    ref_l, ref_p = forward_batched(eng, rows)
    ref = probs(ref_l, rows)
    for name in ("eager",) + FAST:
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

    dev = common.DEVICE
    variants = {"fp32_bf16_weights": lambda: weights_bf16(model.load(ckpt, device=dev, backend="eager",
                                                                     dtype=torch.float32)),
                "eager_fp16": lambda: model.load(ckpt, device=dev, backend="eager", dtype=torch.float16)}
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
        if dev == "cuda":
            torch.cuda.empty_cache()


def section_latency(res: dict, engines: dict, wl: dict) -> None:
    """Our engines on the latency workloads: end-to-end predict/predict_batch and forward only."""
    out = res.setdefault("latency", {})
    for name in FAST + ("eager",):
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
    for name in FAST:
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
    for name in FAST + ("eager",):
        if name not in engines or budget.left() < 30:
            continue
        eng = engines[name][0]
        t = time.perf_counter()
        rows, _ = rows_of(eng, [(states, qs)])
        t_enc = time.perf_counter() - t
        tok = sum(len(r) for r in rows)
        fast = name in FAST   # fold / fold16 are fast engines too
        bud = 65536 if fast else 32768
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
        if budget.left() > (40 if fast else 150):
            t = time.perf_counter()
            eng.predict_batch(states, qs, batch_size=256 if fast else 64, sort_by_length=True)
            t_e2e = time.perf_counter() - t
            rec.update(e2e_s=t_e2e, e2e_tok_s=tok / t_e2e)
        out["ours_" + name] = rec
        log("offline %s: %d tokens, fwd %.0f tok/s (MFU %.2f; one call a chunk %s), e2e %s" % (
            name, tok, rec["fwd_tok_s"], rec["fwd_mfu"], rec.get("fwd_per_chunk_tok_s") and
            "%.0f tok/s" % rec["fwd_per_chunk_tok_s"], rec.get("e2e_tok_s") and "%.0f tok/s" % rec["e2e_tok_s"]))
    if "ours_fast" in out and "gemm" in res:
        out["ours_fast"]["vs_gemm_floor"] = out["ours_fast"]["fwd_tok_s"] / res["gemm"]["floor_tok_s"]
