"""CUDA graphs of the fast forward: the static buffers every graph reads, capture and replay, warm-up.

Per token bucket (and gathered-head capacity) one graph runs the encoder and decision head; per (row bucket,
marker bucket) a small one gathers marker logits and [CLS] states and runs the action head. Activations live in
one set of static buffers sized for the largest bucket and shared by every graph (one forward runs at a time,
under the engine's lock), captured into one memory pool; `warmup` captures every graph before traffic.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .packing import pow2, row_capacity, token_buckets
from .weights import SCORER_PAD

log = logging.getLogger(__name__)


class GraphRunner:
    """The graph part of `FastForward`: buffers, capture, replay and warm-up."""

    def _alloc(self, max_tokens: int) -> None:
        """(Re)allocate the static buffers for buckets up to max_tokens; drops every captured graph."""
        T = token_buckets(max(int(max_tokens), self.max_len))[-1]
        if T <= self.T_max:
            return
        self._graphs.clear()
        self._tail_graphs.clear()
        self._pool = None
        self._warm = False
        self._ran = set()
        dev, adt, d = self.device, self.act_dtype, self.d
        self.T_max = T
        self.buckets = token_buckets(T)
        self.R_max = row_capacity(T)
        self.K_max = pow2(max(2, self.max_len // 4), 2)
        n_int = self._int_size(T)
        pin = dev.type == "cuda"
        self._ints = torch.zeros(n_int, dtype=torch.int32, device=dev)
        rb = pow2(self.R_max)
        n_tail = rb * (self.K_max + 1)
        self._tail = torch.zeros(n_tail, dtype=torch.int32, device=dev)
        # two host staging slots: a multi-chunk forward stages chunk k + 1 on the CPU while the GPU runs chunk k
        # (slot 0 doubles as the staging buffer of warm-up and profile, which run one chunk at a time)
        self._slots = [(torch.zeros(n_int, dtype=torch.int32, pin_memory=pin),
                        torch.zeros(n_tail, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self._slot_done: list[Any] = [None, None]   # the CUDA event after the last chunk that used each slot
        self._ints_host, self._tail_host = self._slots[0]
        # zero-filled so stale padding rows are always finite (attention multiplies them by p = 0)
        # X, O and S have one row more: row T is where the gathered head's padding rows go (never read back)
        self.X = torch.zeros(T + 1, d, dtype=torch.float32, device=dev)
        self.Y = torch.zeros(T, d, dtype=adt, device=dev)
        self.QKV = torch.zeros(T, 3 * d, dtype=adt, device=dev)
        self.O = torch.zeros(T + 1, d, dtype=adt, device=dev)
        self.R = torch.zeros(T, d, dtype=adt, device=dev)
        self.G = torch.zeros(T * max(self.inter, self.ffn, d), dtype=adt, device=dev)
        self.S = torch.zeros(T + 1, SCORER_PAD, dtype=torch.float32, device=dev)
        self.Sg = torch.zeros(T, SCORER_PAD, dtype=torch.float32, device=dev)
        self._zero_bias = torch.zeros(max(3 * d, self.ffn, self.inter, SCORER_PAD), dtype=torch.float32, device=dev)

    def _side_run(self, fn, *args):
        if self.device.type != "cuda":
            return fn(*args)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            out = fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(s)
        return out

    def _capture(self, fn, *args):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = fn(*args)
        return g, out

    def _encoder(self, Tb: int, gb: int) -> None:
        if not self.use_graphs:
            self._body(Tb, gb)
            return
        g = self._graphs.get((Tb, gb))
        if g is None:
            if self._warm:
                self.stats.captures_after_warmup += 1
                log.warning("fast backend: capturing a graph for %d tokens after warm-up", Tb)
            # a kernel's first call (module load, launch attributes) stays outside a capture: one real run per
            # tile regime (the GEMM tiles change past the tuning table's small_m tokens, the add+LayerNorm form at
            # its ln_fold_m), not one per bucket
            regime = (Tb <= self.tuning.small_m, gb <= self.tuning.small_m, self._fold_rows(Tb))
            if regime not in self._ran:
                self._side_run(self._body, Tb, gb)
                self._ran.add(regime)
            g, _ = self._capture(self._body, Tb, gb)
            self._graphs[(Tb, gb)] = g
            self.stats.graphs = len(self._graphs)
        g.replay()

    def _tail_run(self, nb: int, kb: int) -> torch.Tensor:
        if not self.use_graphs:
            return self._tail_body(nb, kb)
        ent = self._tail_graphs.get((nb, kb))
        if ent is None:
            if self._warm:
                self.stats.captures_after_warmup += 1
            self._side_run(self._tail_body, nb, kb)
            ent = self._capture(self._tail_body, nb, kb)
            self._tail_graphs[(nb, kb)] = ent
            self.stats.tail_graphs = len(self._tail_graphs)
        ent[0].replay()
        return ent[1]

    @torch.no_grad()
    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Capture every token-bucket graph up to max_batch_tokens and every tail graph; returns seconds."""
        t = time.perf_counter()
        with self._lock:
            if max_batch_tokens:
                top = self.T_max
                self._alloc(max_batch_tokens)
                if self.T_max > top:
                    self._grown()
            if not self.use_graphs:
                # one real forward per kernel configuration: loads every module before traffic
                small = [b for b in self.buckets if b <= self.tuning.small_m]
                unfolded = [b for b in self.buckets if not self._fold_rows(b)]
                for Tb in sorted(set(small[-1:]) | set(unfolded[-1:]) | {self.buckets[-1]}):
                    self._warm_rows(Tb)
            else:  # each capture is preceded by a real run of the same bucket (see _encoder)
                # the GPU lock per bucket (its work waited for), so other processes' forwards go on in between
                for Tb in reversed(self.buckets):   # largest first, so the pool is sized once
                    with self._gpu():
                        _, gb = self._stage(self._synthetic(Tb), Tb)
                        self._ints[:self._int_size(Tb)].copy_(self._ints_host[:self._int_size(Tb)])
                        for g in sorted({gb, Tb}):   # the gathered head's two capacities
                            if (Tb, g) not in self._graphs:
                                self._encoder(Tb, g)
                        self._sync()
                with self._gpu():
                    for nb in (1 << i for i in range(pow2(self.R_max).bit_length())):
                        for kb in (1 << i for i in range(1, self.K_max.bit_length())):
                            if (nb, kb) not in self._tail_graphs:
                                self._tail_host[:nb * (kb + 1)].fill_(0)
                                self._tail[:nb * (kb + 1)].copy_(self._tail_host[:nb * (kb + 1)])
                                self._tail_run(nb, kb)
                    self._sync()
            self._sync()
            self._warm = True
            self.stats.buckets = list(self.buckets)
        self.stats.warmup_s = time.perf_counter() - t
        return self.stats.warmup_s

    def _warm_rows(self, Tb: int) -> None:
        with self._gpu():
            rows = self._synthetic(Tb)
            _, gb = self._stage(rows, Tb)
            self._ints[:self._int_size(Tb)].copy_(self._ints_host[:self._int_size(Tb)])
            for g in sorted({gb, Tb}):
                self._side_run(self._body, Tb, g)
            self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
