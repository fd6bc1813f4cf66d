"""The GEMM and add+LayerNorm sweeps: every candidate tile config checked against its reference and timed; the
winners go to this run's proposed tuning table; the GEMM floor of the encoder + head at torch.matmul speed."""

from __future__ import annotations

from bench.fastpath.common import bench_gpu, log, proposal, propose


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
    from model.backends.fast.specs import sm_count

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
