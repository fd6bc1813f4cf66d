"""bench/ln_fold_numerics.py: its folded LayerNorm products are the LayerNorm's product (to rounding), its error
grows where the algebra says it must (rows far from zero mean), and it reads every LayerNorm that feeds a GEMM of
a real checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import ln_fold_numerics as lnf  # noqa: E402


def _norm_and_weight(d: int = 256, n: int = 384, bias: bool = False) -> tuple[torch.nn.LayerNorm, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    norm = torch.nn.LayerNorm(d, bias=bias)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
        if bias:
            norm.bias.copy_(0.1 * torch.randn(d, generator=g))
    return norm, 0.03 * torch.randn(n, d, generator=g)


def test_folded_products_match_the_layernorm_product_on_centred_rows():
    norm, w = _norm_and_weight(bias=True)
    x = 3.0 * torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    for dt in (torch.bfloat16, torch.float16):
        r = lnf.compare(x, norm, w, dt)
        assert r["x_fits"]
        assert r["today_rms"] < (0.01 if dt is torch.bfloat16 else 0.002)
        assert 0.7 < r["ratio_g_rms"] < 1.4   # gamma on the rows: the same roundings as today
        assert r["fold_rms"] < 2 * r["today_rms"]
        # statistics of the rounded rows, one pass: a relative 2^-9 (bf16) error in mu and rstd on centred rows
        assert r["fold_s_rms"] < 2 * r["today_rms"] and r["ratio_s_rms"] == r["fold_s_rms"] / r["today_rms"]


def test_folded_error_grows_with_the_rows_mean():
    norm, w = _norm_and_weight()
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) + 40.0   # |mu| / sigma ~ 40
    r = lnf.compare(x, norm, w, torch.bfloat16)
    assert r["max_abs_mu_over_sigma"] > 30
    assert r["ratio_g_rms"] > 10 and r["ratio_rms"] > 10
    # statistics of the rounded rows in one fp32 pass add nothing visible to what rounding x costs: fp32 keeps
    # ~9 bits of E[x^2] - mu^2 at |mu| / sigma ~ 40, more than bf16 keeps of x
    assert 0.8 < r["ratio_s_rms"] / r["ratio_rms"] < 1.25


def test_fp16_overflow_is_reported():
    norm, w = _norm_and_weight()
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4))
    x[0, 0] = 1e5
    assert not lnf.compare(x, norm, w, torch.float16)["x_fits"]
    assert lnf.compare(x, norm, w, torch.bfloat16)["x_fits"]


def test_the_script_reads_every_norm_that_feeds_a_gemm(tiny_checkpoint, tmp_path):
    out = tmp_path / "lnf.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "ln_fold_numerics.py"), "--checkpoint",
                           tiny_checkpoint, "--rows", "3", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    with open(os.path.join(tiny_checkpoint, "encoder", "config.json"), encoding="utf-8") as fh:
        layers = json.load(fh)["num_hidden_layers"]
    # the embeddings' norm, every layer's MLP norm, and every attention norm but layer 0's (an identity)
    assert len(res["norms"]) == 1 + layers + (layers - 1)
    assert res["norms"][:2] == ["embeddings.norm", "layers.0.mlp_norm"]
    for dn in ("bf16", "fp16"):
        assert len(res["dtypes"][dn]) == len(res["norms"])
        assert res["summary"][dn]["worst_ratio_g_rms"] < 1.5
    assert (tmp_path / "lnf.png").stat().st_size > 0
