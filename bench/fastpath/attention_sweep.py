"""The attention sweep: the candidates run in a child process (`bench/fast_path.py --attention-child`), each checked
against the reference and timed on ~64k packed tokens; the parent collects their rows and picks the fastest."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np

from bench.fastpath.common import ENTRY, ROOT, bench_gpu, log


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
        cmd = [sys.executable, ENTRY, "--attention-child", ",".join(todo),
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
    if best and by_tag[best].hp > 1:
        # heads a block is a bucket-size rule (tuning.json's attn_hp / attn_hp_m), timed here on ~64k tokens only:
        # the engines take the one-head form and apply the table's rule, as the forward does
        return replace(by_tag[best], hp=1)
    return by_tag[best] if best else None


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
