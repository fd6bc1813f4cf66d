"""Per-op GPU timing of the fast forward (`FastForward.profile`): CUDA events around each op of one eager forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.sequence import Row


class Profiling:
    """The profiling part of `FastForward`: `_mark` / `_done` bracket an op (no-ops unless `profile` is running)."""

    def _mark(self, kind: str):
        """Start a timed region when profiling (see `profile`); returns a token for `_done`."""
        if self._prof is None:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return kind, ev

    def _done(self, tok) -> None:
        if tok is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._prof.append((tok[0], tok[1], ev))

    @torch.no_grad()
    def profile(self, rows: Sequence[Row], repeats: int = 3) -> dict:
        """GPU time per op kind of one eager forward of `rows` (one chunk): {bucket, tokens, total_ms,
        ops: {kind: ms}, other_ms}; needs CUDA. Medians over `repeats` runs."""
        rows = list(rows)
        self._check(rows)
        with self._lock, self._gpu():
            total = sum(len(r.ids) for r in rows)
            Tb = self.bucket_for(total, len(rows))
            _, g = self._stage(rows, Tb)
            self._ints[:self._int_size(Tb)].copy_(self._ints_host[:self._int_size(Tb)])
            self._body(Tb, g)
            runs = []
            for _ in range(repeats):
                self._prof = []
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                self._body(Tb, g)
                t1.record()
                torch.cuda.synchronize(self.device)
                ops: dict[str, float] = {}
                for kind, a, b in self._prof:
                    ops[kind] = ops.get(kind, 0.0) + a.elapsed_time(b)
                runs.append((t0.elapsed_time(t1), ops))
                self._prof = None
        runs.sort(key=lambda r: r[0])
        tot, ops = runs[len(runs) // 2]
        return {"bucket": Tb, "tokens": total, "rows": len(rows), "head_rows": g, "total_ms": tot, "ops": ops,
                "other_ms": tot - sum(ops.values())}
