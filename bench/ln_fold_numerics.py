"""Numerics of folding a LayerNorm into the GEMM it feeds (the add+LayerNorm fold), on a checkpoint's activations.

Today each LayerNorm that feeds a GEMM writes its rows rounded to the activation dtype p, and the GEMM multiplies
them: y = p(LN(x)) @ p(W)^T. Folded, the residual add's epilogue keeps each row's mean and 1/std and writes x
rounded; the next GEMM multiplies the raw rows by W' = W * gamma (per input column) and corrects in its epilogue:
y = rstd * (p(x) @ p(W')^T - mu * colsum(p(W'))) + W @ beta. Or gamma goes on the rows where they are written
(z = p(x * gamma)) and W stays as the checkpoint has it: y = rstd * (z @ p(W)^T - mu * (p(W) @ gamma)) + W @ beta,
which skips rounding W * gamma. Either rounds x where today rounds the normalised row, so the error grows with
|mu| / sigma of the rows, and in fp16 x itself must fit the format. A third way needs no statistics from the
residual add's epilogue (no atomics across its column tiles): the next GEMM takes mu and rstd from the rounded rows
p(x) it streams through anyway, in one fp32 pass (sum and sum of squares), with W' = W * gamma as in the first.

The encoder runs in fp32 on e-mail-like rows; every LayerNorm whose output feeds Wqkv or Wi (the embeddings' norm,
then each layer's attention and MLP norms) gives its input rows, and both ways are compared against fp64 per
LayerNorm: the error's RMS and max relative to the output's RMS, the rows' largest |mu| / sigma and largest |x|.
Runs on CPU or GPU (`--device`); the GEMMs accumulate in fp32 from rounded inputs, as the kernels do.

    python bench/ln_fold_numerics.py --checkpoint /tmp/ck_large --out bench/results/ln_fold_numerics_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.fastpath.workloads import text  # noqa: E402
from model.backends import torch_encoder as _enc  # noqa: E402
from model.backends.torch_encoder import load_native_model  # noqa: E402
from model.bundle import open_bundle  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


Caught = list[tuple[str, torch.Tensor, torch.nn.Module, torch.Tensor]]


def capture(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Caught:
    """(name, input rows of the real tokens, the LayerNorm, the weight its output feeds) for every such norm."""
    enc = model.encoder
    pairs = [("embeddings.norm", enc.embeddings.norm, enc.layers[0].attn.Wqkv.weight)]
    for i, ly in enumerate(enc.layers):
        if isinstance(ly.attn_norm, torch.nn.LayerNorm):
            pairs.append(("layers.%d.attn_norm" % i, ly.attn_norm, ly.attn.Wqkv.weight))
        pairs.append(("layers.%d.mlp_norm" % i, ly.mlp_norm, ly.mlp.Wi.weight))
    # the encoder calls F.layer_norm directly (torch_encoder.layer_step), so its inputs are taken there, by weight
    by_weight = {id(norm.weight): name for name, norm, _ in pairs}
    seen: dict[str, torch.Tensor] = {}
    real = _enc.F.layer_norm

    def spy(x, shape, weight=None, bias=None, eps=1e-5):
        if weight is not None and id(weight) in by_weight:
            seen[by_weight[id(weight)]] = x.detach()
        return real(x, shape, weight, bias, eps)

    _enc.F.layer_norm = spy
    try:
        with torch.no_grad():
            enc(ids, mask)
    finally:
        _enc.F.layer_norm = real
    missing = [name for name, *_ in pairs if name not in seen]
    if missing:
        raise RuntimeError("the encoder ran no LayerNorm for %s" % missing[:3])
    keep = mask.bool()
    return [(name, seen[name][keep], norm, w) for name, norm, w in pairs]


def compare(x: torch.Tensor, norm: torch.nn.LayerNorm, w: torch.Tensor, dt: torch.dtype) -> dict:
    """Today's and the folded product's errors against fp64 for rows x (fp32) through `norm` into W."""
    eps = float(norm.eps)
    g = norm.weight.double()
    b = norm.bias.double() if norm.bias is not None else None
    xd, wd = x.double(), w.double()
    mu = xd.mean(1, keepdim=True)
    var = xd.var(1, unbiased=False, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    ln = (xd - mu) * rstd * g + (b if b is not None else 0.0)
    ref = ln @ wd.T
    today = ln.to(dt).float() @ w.to(dt).float().T
    wf = (wd * g).to(dt)                                      # W' = W * gamma, rounded once at load
    acc = x.to(dt).float() @ wf.float().T                    # the GEMM on raw rows, fp32 accumulation
    fold = (rstd * (acc.double() - mu * wf.double().sum(1))).float()
    # gamma applied where the rows are written (the producer's epilogue): W stays as the checkpoint has it
    wr = w.to(dt)
    acc = (xd * g).to(dt).float() @ wr.float().T
    fold_g = (rstd * (acc.double() - mu * (wr.double() * g).sum(1))).float()
    # statistics of the rounded rows in one fp32 pass, as the next GEMM's consumers would take them from its A tiles
    xr = x.to(dt).float()
    mu_s = xr.sum(1, keepdim=True) / x.shape[1]
    rstd_s = torch.rsqrt((xr * xr).sum(1, keepdim=True) / x.shape[1] - mu_s * mu_s + eps)
    fold_s = rstd_s * (xr @ wf.float().T - mu_s * wf.float().sum(1))
    if b is not None:
        fold, fold_g, fold_s = fold + (wd @ b).float(), fold_g + (wd @ b).float(), fold_s + (wd @ b).float()
    scale = ref.pow(2).mean().sqrt().item()
    out = {"rows": int(x.shape[0]), "max_abs_mu_over_sigma": (mu.abs() * rstd).max().item(),
           "max_abs_x": x.abs().max().item(), "x_fits": bool(x.abs().max().item() < torch.finfo(dt).max)}
    for name, y in (("today", today), ("fold", fold), ("fold_g", fold_g), ("fold_s", fold_s)):
        err = (y.double() - ref)
        out[name + "_rms"] = err.pow(2).mean().sqrt().item() / scale
        out[name + "_max"] = err.abs().max().item() / scale
    out["ratio_rms"] = out["fold_rms"] / max(out["today_rms"], 1e-30)
    out["ratio_g_rms"] = out["fold_g_rms"] / max(out["today_rms"], 1e-30)
    out["ratio_s_rms"] = out["fold_s_rms"] / max(out["today_rms"], 1e-30)
    return out


def rows(tok, n: int, seed: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n e-mail-like texts of 20-300 words, padded into one batch."""
    rng = random.Random(seed)
    enc = [tok(text(rng, rng.randint(20, 300)))["input_ids"][:max_len] for _ in range(n)]
    L = max(len(e) for e in enc)
    ids = torch.full((n, L), int(tok.pad_token_id), dtype=torch.long)
    mask = torch.zeros((n, L), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, :len(e)] = torch.tensor(e)
        mask[i, :len(e)] = 1
    return ids, mask


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for dt, per in res["dtypes"].items():
        ax.plot([p["today_rms"] for p in per], label="%s today" % dt)
        ax.plot([p["fold_rms"] for p in per], "--", label="%s folded, W * gamma" % dt)
        ax.plot([p["fold_g_rms"] for p in per], ":", label="%s folded, gamma on the rows" % dt)
        ax.plot([p["fold_s_rms"] for p in per], "-.", label="%s folded, W * gamma, statistics of p(x)" % dt)
    ax.set_yscale("log")
    ax.set_xlabel("LayerNorm feeding a GEMM (embeddings, then attention / MLP norm per layer)")
    ax.set_ylabel("RMS error / RMS of the product")
    ax.set_title("LayerNorm folded into the next GEMM: %s" % res["env"]["checkpoint"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="JSON path; the PNG goes beside it")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    bundle = open_bundle(args.checkpoint)
    model = load_native_model(bundle)
    if model is None:
        raise SystemExit("%s is not a ModernBERT checkpoint this script can read" % args.checkpoint)
    model = model.to(args.device)
    ids, mask = rows(bundle.tokenizer, args.rows, args.seed, bundle.max_len)
    t0 = time.perf_counter()
    caught = capture(model, ids.to(args.device), mask.to(args.device))
    res: dict = {"env": {"checkpoint": os.path.basename(os.path.abspath(args.checkpoint)), "device": args.device,
                         "torch": torch.__version__, "rows": args.rows, "tokens": int(mask.sum()),
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                 "norms": [name for name, *_ in caught], "dtypes": {}}
    print("%-22s %6s %8s %8s %10s %10s %10s %10s %6s %6s %6s" % (
        "LayerNorm", "dtype", "|mu|/sd", "max |x|", "today rms", "W*g rms", "g-rows rms", "p(x)-st rms", "ratio",
        "ratio", "ratio"))
    for dn, dt in DTYPES.items():
        per = []
        for name, x, norm, w in caught:
            r = compare(x, norm, w, dt)
            per.append({"norm": name, **r})
            print("%-22s %6s %8.3f %8.3g %10.3g %10.3g %10.3g %10.3g %6.2f %6.2f %6.2f%s" % (
                name, dn, r["max_abs_mu_over_sigma"], r["max_abs_x"], r["today_rms"], r["fold_rms"],
                r["fold_g_rms"], r["fold_s_rms"], r["ratio_rms"], r["ratio_g_rms"], r["ratio_s_rms"],
                "" if r["x_fits"] else "  x overflows " + dn))
        res["dtypes"][dn] = per
        summary = {"x_fits_everywhere": all(q["x_fits"] for q in per)}
        for key in ("ratio_rms", "ratio_g_rms", "ratio_s_rms"):
            worst = max(per, key=lambda q: q[key])
            summary["worst_" + key], summary["worst_" + key + "_norm"] = round(worst[key], 3), worst["norm"]
        res.setdefault("summary", {})[dn] = summary
        print("%s: RMS error against today's at most %.2fx with W * gamma, %.2fx with gamma on the rows, %.2fx with "
              "W * gamma and the statistics of p(x)%s" % (
                  dn, summary["worst_ratio_rms"], summary["worst_ratio_g_rms"], summary["worst_ratio_s_rms"],
                  "" if summary["x_fits_everywhere"] else "; some rows overflow " + dn))
    res["seconds"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(res, png)
    print("wrote %s and %s" % (args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
