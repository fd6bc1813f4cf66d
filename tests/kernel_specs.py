"""The kernels the kernel tests compile: `laya-fleet precompile --tests` builds them ahead of time."""

from __future__ import annotations

from dataclasses import replace

import torch

from bench.fastpath_sweep import ATTENTION, SWEEP_GEGLU, SWEEP_GEMM
from kernels import attention as _attn
from kernels import geglu as _geglu
from kernels import gemm as _gemm
from kernels import gemm_manual as _gm

BF = torch.bfloat16


def test_specs() -> list[tuple[str, tuple]]:
    """The kernels tests/test_kernels.py runs (awkward sizes are runtime M, so few compiles)."""
    out = [("gemm", (3072, 1024, False, "none", c, BF)) for c in (_gemm.SMALL, _gemm.LARGE)]
    out += [("gemm", (1024, 1024, True, "gelu", c, BF)) for c in (_gemm.SMALL, _gemm.LARGE)]
    out += [("gemm", (1024, 2624, False, "none", c, BF)) for c in (_gemm.SMALL, _gemm.LARGE)]
    out += [("gemm", (4096, 1024, True, "relu", _gemm.LARGE, BF)),
            ("gemm", (16, 1024, True, "none", _gemm.NARROW, torch.float32))]
    out += [("geglu", (2624, 1024, c)) for c in (_geglu.SMALL, _geglu.LARGE)]
    pers = _gemm.GemmConfig(bm=128, bn=256, bk=64, stages=3, threads=256, persistent=132)
    out += [("gemm", (3072, 1024, False, "none", pers, BF)),
            ("geglu", (2624, 1024, _geglu.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256, persistent=132)))]
    nows = [c for c in SWEEP_GEMM if not c.ws]
    out += [("gemm", (3072, 1024, False, "none", c, BF)) for c in nows]
    out += [("geglu", (2624, 1024, c)) for c in SWEEP_GEGLU if not c.ws]
    out += [("gemm", (3072, 1024, False, "none", c, BF, BF, 2048)) for c in (_gemm.SMALL, _gemm.LARGE, pers, nows[0])]
    for mode in ("add", "plain", "inplace", "add_inplace"):
        for bias in (False, True):
            out.append(("add_ln", (1024, mode, bias, 1e-5, BF)))
    out.append(("rope", (16,)))
    out += [("quant", (1024, False, BF)), ("quant", (2624, True, BF))]   # tests/test_fp8.py
    out += [("add_ln", (1024, m, False, 1e-5, torch.float8_e4m3fn)) for m in ("add", "inplace")]
    for c in ATTENTION:
        out += [("attention", (16, w, c)) for w in (0, 64)] + [("attention", (2, 0, c))]
    out += [("attention", (h, w, replace(_attn.OVERLAP, hp=hp))) for h, hp in ((3, 2), (5, 4)) for w in (0, 64)]
    return out + manual_test_specs()


GEGLU_TEST_CFGS = (_gm.GEGLU, replace(_gm.GEGLU, inflight=1), replace(_gm.GEGLU, joint=False),
                   replace(_gm.GEGLU, joint=False, inflight=1), replace(_gm.GEGLU, persistent=0, stages=3, cluster=1),
                   replace(_gm.GEGLU, cluster=1, stagger=3), replace(_gm.GEGLU, cluster=1),
                   replace(_gm.GEGLU, inflight=1, pingpong=True))
PINGPONG = replace(_gm.GEMM, inflight=1, pingpong=True)


def manual_test_specs() -> list[tuple[str, tuple]]:
    """The kernels tests/test_gemm_manual.py runs."""
    cfgs = (_gm.GEMM, replace(_gm.GEMM, inflight=1), _gm.GemmWSConfig(stages=4),
            _gm.GemmWSConfig(stages=3, persistent=132), replace(_gm.GEMM, cluster=1, stagger=2),
            replace(_gm.GEMM, cluster=1), PINGPONG, replace(PINGPONG, cluster=1))
    prods = [(3072, 1024, False, "none"), (1024, 2624, False, "none"), (4096, 1024, True, "relu"),
             (1024, 1024, True, "gelu"), (1024, 1000, False, "none")]
    out = [("gemm_ws", (N, K, c, b, a, 0, False, BF)) for c in cfgs for N, K, b, a in prods]
    out += [("gemm_ws", (3072, 1024, c, False, "none", 2048, False, BF))
            for c in (_gm.GEMM, replace(_gm.GEMM, cluster=1, stagger=2), replace(_gm.GEMM, rope_regs=False),
                      replace(_gm.GEMM, cluster=1), PINGPONG)]
    out += [("gemm_ws", (2624, 1024, c, False, "none", 0, True, BF)) for c in GEGLU_TEST_CFGS]
    out += [("gemm_ws", (1024, 1024, _gm.GEMM, True, "none", 0, False, torch.float16))]
    out += [("gemm_ws", (2624, 1024, c, False, "none", 0, True, torch.float16))
            for c in (_gm.GEGLU, replace(_gm.GEGLU, joint=False), replace(_gm.GEGLU, cluster=1))]
    # e4m3 operands (test_fp8_manual_kernels_equal_the_dequantised_product)
    one = replace(_gm.GEMM8, cluster=1)
    out += [("gemm_ws", (2624, 1024, _gm.GEGLU8, False, "none", 0, True, BF, True)),
            ("gemm_ws", (3072, 1024, _gm.GEMM8, False, "none", 2048, False, BF, True)),
            ("gemm_ws", (2624, 1024, _gm.GEMM8, False, "none", 0, False, BF, True)),
            ("gemm_ws", (1024, 2624, one, True, "none", 0, False, BF, True))]
    # the add+LayerNorm fold and the residual epilogue (tests/test_ln_fold.py)
    c1 = replace(_gm.GEMM, cluster=1)
    for dt in (BF, torch.float16):
        out += [("gemm_ws", (3072, 1024, _gm.GEMM, False, "none", 2048, False, dt, False, "fold", 1e-5)),
                ("gemm_ws", (1024, 1000, c1, True, "none", 0, False, dt, False, "fold", 1e-5)),
                ("gemm_ws", (2624, 1024, _gm.GEGLU, False, "none", 0, True, dt, False, "fold", 1e-5))]
    out += [("gemm_ws", (N, K, c1, b, "none", 0, False, BF, False, "residual"))
            for N, K, b in ((1024, 1024, True), (1024, 2624, False), (1000, 1024, True))]
    return out
