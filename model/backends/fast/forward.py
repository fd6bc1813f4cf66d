"""The fast forward's layer body and op dispatch: every op a TileLang kernel or its torch reference.

The encoder and decision head run over one packed token bucket (packing.py) in static buffers (graphs.py): GEMM
with a bias / activation epilogue (Wqkv with RoPE fused), GEMM + GeGLU, residual add + LayerNorm, packed attention.
After the head's last attention only marker and [CLS] rows are read, so that layer's rest and the scorer run on
those rows gathered. `ops="torch"` swaps every kernel for its torch reference (same packing, same buffers), which
also runs on CPU. specs.py lists the kernels a model of a shape launches, for warm-up and `precompile`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kernels import _tl
from kernels import attention as _attn
from kernels import geglu as _geglu
from kernels import gemm as _gemm
from kernels import gemm_manual as _gm
from kernels import layernorm as _ln
from kernels import ln_fold as _lnf
from kernels import rope as _rope
from kernels.tuning import pick_add_ln, pick_attention, pick_geglu, pick_gemm, pick_gemm_ws, pick_gemm_ws8
from model.network import confidence_features
from model.sequence import Row

from . import fp8 as _fp8
from .packing import pow2
from .profiling import Profiling


class ForwardOps(Profiling):
    """The op dispatch and layer body of `FastForward` (see the module docstring)."""

    def _gpu(self):
        """The cross-process GPU lock held over a block of GPU work whose end the block waits for
        (model/backends/gpu_lock.py), or a no-op without one."""
        return self.gpu_lock if self.gpu_lock is not None else contextlib.nullcontext()

    def _ws_cfg(self, M: int, N: int, in_dtype: torch.dtype, out_dtype: torch.dtype, geglu: bool = False,
                K: int | None = None) -> _gm.GemmWSConfig | None:
        """The hand-warp-specialised config of this product, or None for kernels/gemm.py and kernels/geglu.py."""
        return pick_gemm_ws(M, N, in_dtype, out_dtype, geglu, K, arch=self.arch, sms=self.sms, table=self.tuning)

    def _gemm(self, a, w, bias, out, act="none"):
        tok = self._mark("gemm %dx%d" % (w.shape[0], w.shape[1]))
        if isinstance(w, _fp8.Fp8Weight):   # the FP8 precision's encoder GEMMs (fp8.py); `a` may come quantised
            _fp8.gemm(a, w, bias, act, self.ops["gemm"], out, self._ws8(out.shape[0], w.shape[0], w.shape[1]),
                      self._zero_bias)
        elif self.ops["gemm"] == "tilelang":
            M, N = a.shape[0], w.shape[0]
            b = bias if bias is not None else self._zero_bias[:N]
            ws = self._ws_cfg(M, N, a.dtype, out.dtype, K=a.shape[1])
            if ws is not None:
                _gm.gemm_manual_kernel(N, a.shape[1], ws, bias is not None, act, 0, False, a.dtype)(a, w, b, out)
            else:
                cfg = pick_gemm(M, N, a.shape[1], self.tuning)
                _gemm.gemm_kernel(N, a.shape[1], bias is not None, act, cfg, out.dtype, a.dtype)(a, w, b, out)
        else:
            out.copy_(_gemm.gemm_ref(a, w, bias, act, out.dtype))
        self._done(tok)

    def _ws8(self, M: int, N: int, K: int, geglu: bool = False) -> _gm.GemmWSConfig | None:
        """The FP8 precision's hand-warp-specialised config of this product (K deep), or None for cuBLAS's."""
        if self.ops["geglu" if geglu else "gemm"] != "tilelang":
            return None
        return pick_gemm_ws8(M, N, geglu, K, arch=self.arch, sms=self.sms, table=self.tuning)

    def _fused_rope(self, M: int) -> bool:
        """Whether Wqkv's GEMM rotates Q and K in its epilogue at M tokens (both ops TileLang, a 64-wide tile)."""
        if self.fp8:
            return self.ops["rope"] == "tilelang" and self._ws8(M, 3 * self.d, self.d) is not None
        return (self.ops["gemm"] == "tilelang" and self.ops["rope"] == "tilelang"
                and (self._ws_cfg(M, 3 * self.d, self.act_dtype, self.act_dtype, K=self.d) is not None
                     or pick_gemm(M, 3 * self.d, self.d, self.tuning).bn % 64 == 0))

    def _qkv(self, a, ly, pos, table, out):
        """Wqkv and RoPE: one GEMM with a rotating epilogue, or the GEMM then the RoPE op (`a` may come quantised
        under FP8)."""
        M = out.shape[0]
        if not self._fused_rope(M):
            self._gemm(a, ly.wqkv, ly.bqkv, out)
            self._rope(out, pos, table)
            return
        N, K = ly.wqkv.shape
        tok = self._mark("gemm %dx%d+rope" % (N, K))
        if self.fp8:
            q = a if isinstance(a, tuple) else _fp8.quantize_rows(a, "tilelang")
            _fp8.ws_product(q, ly.wqkv, out, self._ws8(M, N, K), ly.bqkv, self._zero_bias,
                            (2 * self.d, pos, table[0], table[1]))
            self._done(tok)
            return
        b = ly.bqkv if ly.bqkv is not None else self._zero_bias[:N]
        ws = self._ws_cfg(M, N, a.dtype, out.dtype, K=K)
        if ws is not None:
            kern = _gm.gemm_manual_kernel(N, K, ws, ly.bqkv is not None, "none", 2 * self.d, False, a.dtype)
        else:
            cfg = pick_gemm(M, N, K, self.tuning)
            kern = _gemm.gemm_kernel(N, K, ly.bqkv is not None, "none", cfg, out.dtype, a.dtype, 2 * self.d)
        kern(a, ly.wqkv, b, out, pos, table[0], table[1])
        self._done(tok)

    def _geglu(self, a, wi, out):
        tok = self._mark("geglu %dx%d" % (wi.shape[0] // 2, wi.shape[1]))
        if isinstance(wi, _fp8.Fp8Weight):   # quantised for the next GEMM: (e4m3, scales), not `out`
            ws8 = self._ws8(out.shape[0], wi.shape[0] // 2, wi.shape[1], True)
            out = _fp8.geglu(a, wi, self.ops["gemm"], self.ops["geglu"], ws8, out)
        elif self.ops["geglu"] == "tilelang":
            Fd = wi.shape[0] // 2
            ws = self._ws_cfg(a.shape[0], Fd, a.dtype, out.dtype, geglu=True, K=a.shape[1])
            if ws is not None:
                _gm.gemm_manual_kernel(Fd, a.shape[1], ws, False, "none", 0, True, a.dtype)(a, wi, out)
            else:
                cfg = pick_geglu(a.shape[0], Fd, a.shape[1], self.tuning)
                _geglu.geglu_kernel(Fd, a.shape[1], cfg, a.dtype)(a, wi, out)
        else:
            out.copy_(_geglu.geglu_ref(a, wi))
        self._done(tok)
        return out

    def _add_ln(self, x, r, norm, eps, y, mode, quant=False):
        """`y` = the norm of the stream (after the residual add), or with `quant` (FP8: the norm feeds an encoder
        GEMM) its rows in e4m3 and their scales, returned instead of y."""
        tok = self._mark("add_ln")
        wt, b = norm[0], norm[1]
        if quant:
            y = _fp8.add_ln(x, r, wt, b, eps, mode, self.ops["add_ln"], self.R, pick_add_ln(x.shape[1], self.tuning))
        elif self.ops["add_ln"] == "tilelang":
            rr = r if r is not None else self.R[:x.shape[0]]   # not read, but the host stub checks it
            cfg = pick_add_ln(x.shape[1], self.tuning)
            _ln.add_ln_kernel(x.shape[1], mode, b is not None, eps, y.dtype, cfg, rr.dtype)(
                x, rr, wt, b if b is not None else wt, y)
        else:
            xn, yn = _ln.add_ln_ref(x, r, wt, b, eps, mode, y.dtype)
            if mode != "plain":
                x.copy_(xn)
            y.copy_(yn)
        self._done(tok)
        return y

    def _fold_rows(self, M: int) -> bool:
        """Whether a bucket of M tokens runs the encoder with its add+LayerNorm folded into the GEMMs (the tuning
        table's ln_fold_m; the forms are the hand-warp-specialised kernels', or the torch references)."""
        if not self.fold or M < self.tuning.ln_fold_m or self.ops["gemm"] != self.ops["geglu"]:
            return False
        d, dt = self.d, self.act_dtype
        return self.ops["gemm"] == "torch" or all(
            self._ws_cfg(M, N, dt, dt, g, K) is not None
            for N, K, g in ((3 * d, d, False), (d, d, False), (self.inter, d, True), (d, self.inter, False)))

    def _qkv_fold(self, p, ly, pos, table, out):
        """Wqkv over the rounded stream `p` with the attention norm folded in (kernels/ln_fold.py), then RoPE."""
        M, (N, K) = out.shape[0], ly.wqkv.shape
        tok = self._mark("gemm %dx%d+ln" % (N, K))
        fused = self._fused_rope(M)
        if self.ops["gemm"] == "tilelang":
            b = ly.bqkv if ly.bqkv is not None else self._zero_bias[:N]
            kern = _gm.gemm_manual_kernel(N, K, self._ws_cfg(M, N, p.dtype, out.dtype, K=K), ly.bqkv is not None,
                                          "none", 2 * self.d if fused else 0, False, p.dtype, ln="fold", eps=self.eps)
            kern(p, ly.wqkv, b, ly.cs_qkv, out, *((pos, table[0], table[1]) if fused else ()))
        else:
            fused = False
            out.copy_(_lnf.fold_ref(p, ly.wqkv, ly.cs_qkv, ly.bqkv, self.eps))
        self._done(tok)
        if not fused:
            self._rope(out, pos, table)

    def _geglu_fold(self, p, ly, out):
        tok = self._mark("geglu %dx%d+ln" % (ly.wi.shape[0] // 2, ly.wi.shape[1]))
        if self.ops["geglu"] == "tilelang":
            Fd, K = ly.wi.shape[0] // 2, ly.wi.shape[1]
            ws = self._ws_cfg(p.shape[0], Fd, p.dtype, out.dtype, geglu=True, K=K)
            _gm.gemm_manual_kernel(Fd, K, ws, False, "none", 0, True, p.dtype, ln="fold", eps=self.eps)(
                p, ly.wi, ly.cs_i, out)
        else:
            out.copy_(_lnf.geglu_fold_ref(p, ly.wi, ly.cs_i, self.eps))
        self._done(tok)
        return out

    def _residual(self, a, w, bias, x, p):
        """The stream x += a @ w^T + bias in the GEMM's epilogue, and p = x rounded (the next fold's input)."""
        tok = self._mark("gemm %dx%d+add" % (w.shape[0], w.shape[1]))
        if self.ops["gemm"] == "tilelang":
            N, K = w.shape
            b = bias if bias is not None else self._zero_bias[:N]
            _gm.gemm_manual_kernel(N, K, self._ws_cfg(a.shape[0], N, a.dtype, p.dtype, K=K), bias is not None,
                                   "none", 0, False, a.dtype, ln="residual")(a, w, b, x, p)
        else:
            xn, pn = _lnf.residual_ref(a, w, bias, x)
            x.copy_(xn)
            p.copy_(pn)
        self._done(tok)

    def _rope(self, qkv, pos, table):
        tok = self._mark("rope")
        cos, sin = table
        if self.ops["rope"] == "tilelang":
            _rope.rope_kernel(self.heads, dtype=qkv.dtype)(qkv, pos, cos, sin)
        else:
            qkv.copy_(_rope.rope_ref(qkv, pos, cos, sin, self.heads))
        self._done(tok)

    def _attention(self, qkv, v, heads, window, out):
        tok = self._mark("attention %s" % ("window %d" % window if window else "full %d heads" % heads))
        if self.ops["attention"] == "tilelang":
            cfg = pick_attention(qkv.shape[0], self.attn_cfg, self.tuning)   # qkv holds the whole bucket
            _attn.attention_kernel(heads, window, cfg, qkv.dtype)(qkv, v["cu"], v["tiles"], out)
        elif qkv.is_cuda:  # a dense mask needs no host sync, so the forward can be graph-captured
            out.copy_(_attn.attention_dense(qkv, v["trow"], v["pos"], heads, window))
        else:  # CPU: row by row, the sum of each row's L^2 rather than the chunk's T^2
            out.copy_(_attn.attention_ref(qkv, v["cu"], heads, window))
        self._done(tok)

    def _body(self, Tb: int, g: int) -> None:
        """The encoder and head over bucket Tb; the head's last layer after its attention, and the scorer, on the
        g rows listed in gidx (marker and [CLS] tokens, then padding pointing at the scratch row T_max)."""
        with _tl.pdl_scope(self._pdl_rows(Tb)):
            self._body_ops(Tb, g)

    def _pdl_rows(self, M: int) -> bool:
        """Whether ops over M rows run the programmatic-dependent-launch builds (the PDL mode, `self.pdl`)."""
        return self.pdl == "all" or (self.pdl == "small" and M <= self.tuning.small_m)

    def _body_ops(self, Tb: int, g: int) -> None:
        v = self._views(Tb)
        X, Y, QKV, Ob, R = self.X[:Tb], self.Y[:Tb], self.QKV[:Tb], self.O[:Tb], self.R[:Tb]
        torch.index_select(self.emb, 0, v["ids"], out=X)
        q8 = self.fp8   # under FP8 the norms that feed the encoder's GEMMs hand them e4m3 rows and their scales
        Yq = self._add_ln(X, None, self.emb_norm, self.eps, Y, "inplace", q8)
        n = len(self.layers)
        fold = self._fold_rows(Tb)
        for i, ly in enumerate(self.layers):
            if fold and ly.cs_qkv is not None:   # Y holds the stream rounded (the last _residual's)
                self._qkv_fold(Y, ly, v["pos"], self.rope_tables[ly.rope], QKV)
            else:
                self._qkv(Yq, ly, v["pos"], self.rope_tables[ly.rope], QKV)
            self._attention(QKV, v, self.heads, ly.window, Ob)
            if fold:
                G = self.G[:Tb * self.inter].view(Tb, self.inter)
                self._residual(Ob, ly.wo, ly.bo, X, Y)
                self._residual(self._geglu_fold(Y, ly, G), ly.wo2, ly.bo2, X, Y)
                if i + 1 == n:
                    self._add_ln(X, None, self.final_norm, self.eps, Y, "inplace")
                continue
            self._gemm(Ob, ly.wo, ly.bo, R)
            Yq = self._add_ln(X, R, ly.mlp_norm, self.eps, Y, "add", q8)
            G = self.G[:Tb * self.inter].view(Tb, self.inter)
            self._gemm(self._geglu(Yq, ly.wi, G), ly.wo2, ly.bo2, R)
            if i + 1 < n:
                Yq = self._add_ln(X, R, self.layers[i + 1].attn_norm, self.eps, Y, "add", q8)
            else:
                self._add_ln(X, R, self.final_norm, self.eps, Y, "add_inplace")
        X.add_(self.type_emb.index_select(0, v["ttype"]))
        hn = len(self.head_layers)
        h0 = self.head_layers[0]
        self._add_ln(X, None, h0.norm1[:2], h0.norm1[2], Y, "plain")
        F1 = self.G[:Tb * self.ffn].view(Tb, self.ffn)
        for j, hl in enumerate(self.head_layers):
            self._gemm(Y, hl.win, hl.bin, QKV)
            self._attention(QKV, v, self.head_heads, 0, Ob)
            if j + 1 == hn:
                with _tl.pdl_scope(self._pdl_rows(g)):
                    self._head_tail(hl, v["gidx"][:g], g)
                return
            self._gemm(Ob, hl.wout, hl.bout, R)
            self._add_ln(X, R, hl.norm2[:2], hl.norm2[2], Y, "add")
            self._gemm(Y, hl.w1, hl.b1, F1, "relu")
            self._gemm(F1, hl.w2, hl.b2, R)
            nxt = self.head_layers[j + 1].norm1
            self._add_ln(X, R, nxt[:2], nxt[2], Y, "add")

    def _head_tail(self, hl: Any, gi: torch.Tensor, g: int) -> None:
        """The head's last layer after its attention, and the scorer, on the g gathered rows `gi` (token indices);
        their residual rows and scores are written back to X and S at those indices. The free QKV buffer holds
        the gathered residual (fp32) and attention output."""
        d = self.d
        flat = self.QKV.view(-1)
        Xg = flat.view(torch.float32)[:g * d].view(g, d)
        off = g * d * 4 // flat.element_size()
        Og = flat[off:off + g * d].view(g, d)
        torch.index_select(self.O, 0, gi, out=Og)
        torch.index_select(self.X, 0, gi, out=Xg)
        Rg, Yg = self.R[:g], self.Y[:g]
        Fg = self.G[:g * self.ffn].view(g, self.ffn)
        self._gemm(Og, hl.wout, hl.bout, Rg)
        self._add_ln(Xg, Rg, hl.norm2[:2], hl.norm2[2], Yg, "add")
        self._gemm(Yg, hl.w1, hl.b1, Fg, "relu")
        self._gemm(Fg, hl.w2, hl.b2, Rg)
        self._add_ln(Xg, Rg, self.scorer_norm[:2], self.scorer_norm[2], Yg, "add")
        Hg = self.G[:g * d].view(g, d)
        self._gemm(Yg, self.scorer_w1, self.scorer_b1, Hg, "gelu")
        self._gemm(Hg, self.scorer_w2, self.scorer_b2, self.Sg[:g])
        idx = gi.long()
        self.X.index_copy_(0, idx, Xg)
        self.S.index_copy_(0, idx, self.Sg[:g])

    def _tail_body(self, nb: int, kb: int, ints: torch.Tensor | None = None) -> torch.Tensor:
        ints = self._tail if ints is None else ints
        mk = ints[:nb * kb].view(nb, kb)
        cls = ints[nb * kb:nb * kb + nb]
        valid = mk >= 0
        s = self.S[:, 0]
        logits = s.index_select(0, mk.clamp(min=0).reshape(-1)).view(nb, kb).masked_fill(~valid, -1e4)
        feats = confidence_features(logits, valid)
        h0 = self.X.index_select(0, cls)
        act = self.act_head(torch.cat([h0, feats], -1)).float()
        return torch.cat([logits, torch.softmax(act, -1)[:, :1]], 1)

    @torch.no_grad()
    def _stage_slot(self, rows: Sequence[Row], slot: int) -> tuple[np.ndarray, int]:
        """Host work only: stage one chunk in host slot `slot` (once the chunk that last used it has been read)."""
        if self._slot_done[slot] is not None:
            self._slot_done[slot].synchronize()
        return self._stage(rows, self.bucket_for(sum(len(r.ids) for r in rows), len(rows)), self._slots[slot][0])

    def _launch_chunk(self, rows: Sequence[Row], slot: int, staged: tuple | None = None
                      ) -> tuple[torch.Tensor, Any, int, int]:
        """Stage one chunk in host slot `slot` (unless `staged` by `_stage_slot`) and queue its GPU work (encoder
        graph, tail, the copy of its outputs to pinned host memory) without waiting for it; returns (host outputs,
        done event, kmax, kb)."""
        n = len(rows)
        total = sum(len(r.ids) for r in rows)
        Tb = self.bucket_for(total, n)
        cuda = self.device.type == "cuda"
        ints_host, tail_host = self._slots[slot]
        cu, gb = staged if staged is not None else self._stage_slot(rows, slot)
        size = self._int_size(Tb)
        self._ints[:size].copy_(ints_host[:size], non_blocking=True)
        self._encoder(Tb, gb)
        kmax = max((len(r.markers) for r in rows), default=0)
        nb = pow2(n)
        kb = pow2(kmax, 2)
        m = nb * (kb + 1)
        if kb <= self.K_max:
            self._stage_tail(rows, cu, nb, kb, tail_host.numpy())
            self._tail[:m].copy_(tail_host[:m], non_blocking=True)
            res = self._tail_run(nb, kb)
        else:  # more markers than any tail graph holds: run the (small) tail eagerly
            st = np.empty(m, dtype=np.int32)
            self._stage_tail(rows, cu, nb, kb, st)
            self.stats.eager_tails += 1
            res = self._tail_body(nb, kb, torch.from_numpy(st).to(self.device))
        # res is a static buffer the next chunk's tail overwrites: copy it out now (stream order keeps the copy
        # ahead of that overwrite)
        out = torch.empty((n, res.shape[1]), dtype=res.dtype, pin_memory=cuda)
        out.copy_(res[:n], non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        self._slot_done[slot] = done
        self.stats.chunks += 1
        self.stats.tokens += total
        self.stats.padded_tokens += Tb
        return out, done, kmax, kb

    @staticmethod
    def _collect(pending: tuple[torch.Tensor, Any, int, int]) -> tuple[np.ndarray, np.ndarray]:
        out, done, kmax, kb = pending
        if done is not None:
            done.synchronize()
        o = out.numpy()
        return np.ascontiguousarray(o[:, :kmax]), np.ascontiguousarray(o[:, kb])

    def forward(self, rows: Sequence[Row], max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Score rows: (logits [N, kmax] float32 with -1e4 past each row's k, P(action 0) [N] float32). Rows are cut
        into chunks of at most min(T_max, max_tokens) tokens (a longer row is a chunk of its own)."""
        rows = list(rows)
        if not rows:
            return np.zeros((0, 0), np.float32), np.zeros((0,), np.float32)
        self._check(rows)
        with self._lock:
            chunks = self._chunks(rows, max_tokens)
            first = self._stage_slot(chunks[0], 0)   # before the GPU lock: another process's forward runs meanwhile
            with self._gpu():   # _collect waits for every chunk before the GPU lock goes
                self.stats.forwards += 1
                # every chunk is queued before any is collected: while the GPU runs chunk k the host stages chunk
                # k + 1 (two staging slots; a slot is refilled only after its previous chunk's GPU work is done)
                pending = [self._launch_chunk(c, i % 2, first if i == 0 else None) for i, c in enumerate(chunks)]
                parts = [self._collect(p) for p in pending]
        return self._assemble(rows, parts)

    def launch(self, rows: Sequence[Row]) -> Launched | None:
        """`forward(rows)` queued on the GPU without waiting for it: a `Launched` to poll and collect, which holds
        the forward's lock until collected. None (nothing queued) when the rows take more than one chunk or
        another forward holds the lock: `forward` then runs them. The caller must collect what it launched."""
        rows = list(rows)
        if not rows:
            return None
        self._check(rows)
        chunks = self._chunks(rows)
        if len(chunks) != 1 or not self._lock.acquire(blocking=False):
            return None
        if self.gpu_lock is not None and not self.gpu_lock.acquire(blocking=False):
            self._lock.release()   # another process's forward is on the GPU: the caller's blocking path waits
            return None
        try:
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                self.stats.forwards += 1
                pending = self._launch_chunk(chunks[0], 0)
        except BaseException:
            self._release()
            raise
        # the GPU lock goes back as soon as the GPU is done, not when this thread comes round to collecting
        released = self.gpu_lock.release_after(pending[1]) if self.gpu_lock is not None else None
        return Launched(self, rows, pending, released)

    def _release(self, released: Any = None) -> None:
        """Give back what `launch` took: the GPU lock (or wait for `released`, its handed-over release), then the
        engine lock."""
        try:
            if released is not None:
                released.wait()
            elif self.gpu_lock is not None:
                self.gpu_lock.release()
        finally:
            self._lock.release()

    @staticmethod
    def _assemble(rows: Sequence[Row], parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        kmax = max(len(r.markers) for r in rows)
        logits = np.full((len(rows), kmax), -1e4, dtype=np.float32)
        pos = 0
        for lg, _ in parts:
            logits[pos:pos + lg.shape[0], :lg.shape[1]] = lg
            pos += lg.shape[0]
        return logits, np.concatenate([p for _, p in parts]).astype(np.float32)


class Launched:
    """A one-chunk forward queued by `ForwardOps.launch`: `ready()` says (without waiting) whether its GPU work is
    done; `collect()` waits for it, releases the forward's engine lock once the GPU lock is back (`released`, set by
    the lock's release thread when the GPU is done) and returns `forward`'s (logits, P(action 0)). The engine lock is
    re-entrant, held by the launching thread: collect on that thread."""

    def __init__(self, fwd: ForwardOps, rows: list[Row], pending: tuple, released: Any = None):
        self._fwd, self._rows, self._pending, self._released = fwd, rows, pending, released
        self._out: tuple[np.ndarray, np.ndarray] | None = None

    def ready(self) -> bool:
        done = self._pending[1]
        return self._out is not None or done is None or done.query()

    def collect(self) -> tuple[np.ndarray, np.ndarray]:
        if self._out is None:
            try:
                part = self._fwd._collect(self._pending)
            finally:
                self._fwd._release(self._released)
            self._out = self._fwd._assemble(self._rows, [part])
        return self._out
