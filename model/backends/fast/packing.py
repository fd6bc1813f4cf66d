"""Packing: a batch of rows as one stream of tokens, padded at the end to a token bucket.

The host builds, per chunk, the token ids, each token's position inside its row (RoPE), its question type and row
id, cu_seqlens, the attention tile table and the gathered head rows, in one int32 staging buffer sent in one copy.
Padding tokens belong to no row and are never read back. `Packing` is the fast forward's host side: buckets,
staging, validation and chunking; it reads the buffers `graphs.GraphRunner._alloc` sizes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from kernels import attention as _attn
from model.sequence import Row

# After the head's last attention only marker and [CLS] tokens are read: the rest runs on at most Tb / GATHER_DIV
# gathered rows (a batch with more runs on all Tb rows; each token bucket has a graph for either capacity)
GATHER_DIV = 8


def gather_capacity(Tb: int) -> int:
    """The rows the head's last layer runs on in a gathered forward of bucket Tb."""
    return max(1, Tb // GATHER_DIV)


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets up to max_tokens (rounded up to 64): steps of 64 to 512, then 8 per octave (a batch
    pads at most 12.5%, 6% on average; 10 x 3 rows of 512 tokens fill the 15360 bucket exactly)."""
    top = max(64, -(-int(max_tokens) // 64) * 64)
    out = list(range(64, min(top, 512), 64))
    e = 512
    while e < top:
        out.extend(v for v in range(e, 2 * e, e // 8) if v < top)
        e *= 2
    out.append(top)
    return sorted(set(out))


def row_capacity(tokens: int) -> int:
    """How many rows a token bucket takes (its attention grid has this many spare tiles for the rows'
    partial tiles; batches of rows averaging under 16 tokens move up to a larger bucket)."""
    return min(tokens, max(8, tokens // 16))


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two at least n (and at least lo)."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


class Packing:
    """The host side of `FastForward`: which bucket a chunk takes, its staging, and how rows are cut into chunks."""

    def _views(self, Tb: int) -> dict[str, torch.Tensor]:
        R = row_capacity(Tb)
        nt = -(-Tb // self.attn_cfg.bm) + R
        ints = self._ints
        o = 4 * Tb
        e = o + R + 2 + 2 * nt
        return {"ids": ints[0:Tb], "pos": ints[Tb:2 * Tb], "ttype": ints[2 * Tb:3 * Tb], "trow": ints[3 * Tb:o],
                "cu": ints[o:o + R + 2], "tiles": ints[o + R + 2:e].view(nt, 2), "gidx": ints[e:e + Tb]}

    def _int_size(self, Tb: int) -> int:
        R = row_capacity(Tb)
        return 5 * Tb + R + 2 + 2 * (-(-Tb // self.attn_cfg.bm) + R)


    def bucket_for(self, tokens: int, rows: int) -> int:
        """The smallest token bucket holding `tokens` tokens in `rows` rows (ValueError if none does)."""
        for b in self.buckets:
            if b >= tokens and row_capacity(b) >= rows:
                return b
        raise ValueError("%d tokens in %d rows exceed the largest bucket (%d tokens, %d rows)"
                         % (tokens, rows, self.T_max, self.R_max))

    def _stage(self, rows: Sequence[Row], Tb: int, host: torch.Tensor | None = None) -> tuple[np.ndarray, int]:
        """Fill a host staging buffer (default: slot 0's) for one chunk; returns cu_seqlens (int64, n + 1) and the
        rows the head's last layer runs on (gather_capacity(Tb), or Tb when more tokens are read back)."""
        n = len(rows)
        lens = np.fromiter((len(r.ids) for r in rows), dtype=np.int64, count=n)
        total = int(lens.sum())
        R = row_capacity(Tb)
        nt = -(-Tb // self.attn_cfg.bm) + R
        st = (self._ints_host if host is None else host).numpy()
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        if all(r.arr is not None and len(r.arr) == len(r.ids) for r in rows):   # rows from SequenceBuilder
            np.concatenate([r.arr for r in rows], out=st[0:total])
        else:
            st[0:total] = np.fromiter(itertools.chain.from_iterable(r.ids for r in rows), dtype=np.int32,
                                      count=total)
        st[total:Tb] = self.pad_id
        starts = np.repeat(cu[:-1], lens)
        st[Tb:Tb + total] = np.arange(total) - starts
        st[Tb + total:2 * Tb] = 0
        st[2 * Tb:2 * Tb + total] = np.repeat(np.fromiter((r.qtype for r in rows), dtype=np.int64, count=n), lens)
        st[2 * Tb + total:3 * Tb] = 0
        st[3 * Tb:3 * Tb + total] = np.repeat(np.arange(n), lens)
        st[3 * Tb + total:4 * Tb] = -1
        o = 4 * Tb
        st[o:o + n + 1] = cu
        st[o + n + 1:o + R + 2] = total
        e = o + R + 2 + 2 * nt
        st[o + R + 2:e] = _attn.tile_table(lens, self.attn_cfg.bm, nt, empty_row=R).reshape(-1)
        # the tokens read back (every marker, every [CLS]), then the scratch row T_max; when they do not fit in the
        # gathered capacity (or repeat markers past Tb), every token of the bucket, in order
        ks = np.fromiter((len(r.markers) for r in rows), dtype=np.int64, count=n)
        k = int(ks.sum())
        gid = st[e:e + Tb]
        cap = gather_capacity(Tb)
        if k + n > cap:
            gid[:] = np.arange(Tb)
            return cu, Tb
        gid[:k] = np.fromiter(itertools.chain.from_iterable(r.markers for r in rows), dtype=np.int64, count=k) \
            + np.repeat(cu[:-1], ks)
        gid[k:k + n] = cu[:-1]
        gid[k + n:] = self.T_max
        return cu, cap

    @staticmethod
    def _stage_tail(rows: Sequence[Row], cu: np.ndarray, nb: int, kb: int, st: np.ndarray) -> None:
        """Write marker token indices [nb, kb] (-1 = none) and [CLS] token indices [nb] into st."""
        mk = st[:nb * kb].reshape(nb, kb)
        mk.fill(-1)
        for i, r in enumerate(rows):
            if r.markers:
                mk[i, :len(r.markers)] = np.asarray(r.markers, dtype=np.int64) + cu[i]
        cls = st[nb * kb:nb * kb + nb]
        cls.fill(0)
        cls[:len(rows)] = cu[:-1]

    @property
    def max_row_tokens(self) -> int:
        """The most tokens one row may hold: the encoder's position range (its RoPE tables), within the buffers."""
        return min(self.max_positions, self.T_max)

    def _check(self, rows: Sequence[Row]) -> None:
        limit = self.max_row_tokens
        for i, r in enumerate(rows):
            n = len(r.ids)
            if n == 0:
                raise ValueError("row %d has no tokens" % i)
            if n > limit:
                raise ValueError("row %d has %d tokens; the fast backend takes at most %d tokens per row "
                                 "(the encoder's positions, within its buffers)" % (i, n, limit))
            if r.markers and (min(r.markers) < 0 or max(r.markers) >= n):
                raise ValueError("row %d has a marker outside its %d tokens" % (i, n))
            if r.qtype not in (0, 1, 2):
                raise ValueError("row %d has question type %r (expected 0, 1 or 2)" % (i, r.qtype))

    def _chunks(self, rows: Sequence[Row], max_tokens: int | None = None) -> list[Sequence[Row]]:
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError("max_tokens must be a positive integer, got %r" % (max_tokens,))
        cap = self.T_max if max_tokens is None else min(self.T_max, max_tokens)
        out, start, total = [], 0, 0
        for i, r in enumerate(rows):
            n = len(r.ids)
            if i > start and (total + n > cap or i - start >= self.R_max):
                out.append(rows[start:i])
                start, total = i, 0
            total += n
        out.append(rows[start:])
        return out

    def _synthetic(self, Tb: int) -> list[Row]:
        """Rows that fill bucket Tb exactly (each at most max_len tokens, two markers)."""
        n = max(-(-Tb // self.max_len), 1)
        base, extra = divmod(Tb, n)
        return [Row([self.pad_id] * (base + (i < extra)), [0, 1], 0) for i in range(n)]
