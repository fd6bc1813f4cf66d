"""The run summary: the collector's counts and the scorer actors' reports, as JSON and as a short text block."""

from __future__ import annotations

import time
from dataclasses import asdict

from .config import Job, OfflineConfig
from .io import InputFile, OutputDir
from .write import Collector


def summarize(cfg: OfflineConfig, job: Job, out: OutputDir, done: list[InputFile], pending: list[InputFile],
              c: Collector, scorers: dict[str, dict], plan: dict, seconds: float) -> dict:
    """The run summary: rows, errors, tokens, time, throughput, GPUs, budgets, padding overhead.

    `scorers` maps "actor id/pid" to that scorer process's last report (`ScoreStage.stats`).
    """
    reports = list(scorers.values())
    scored = [st["stats"] for st in reports]
    tok = sum(s["tokens"] for s in scored)
    padded = sum(s["padded_tokens"] for s in scored)
    packed = any(st.get("packed") for st in reports)
    actor_ids = {st.get("actor") for st in reports}
    gpu_ids = sorted({"%s:%s" % (st.get("node"), g) for st in reports for g in st.get("gpus") or []})
    # "After start-up": from the first scorer actor ready (model loaded, warmed up) to the end; the
    # fair comparison with an in-process scorer timed after its own load and warm-up.
    ready = min((st["ready_at"] for st in reports if st.get("ready_at")), default=None)
    after_ready = time.time() - ready if ready else None
    left = len(job.files) - len(done) - len(pending)
    tl = c.timeline
    if len(tl) > 400:
        tl = tl[::len(tl) // 400 + 1] + [tl[-1]]
    return {
        "output": out.root, "input_files": len(job.files) + len(job.bad), "files_skipped_done": len(done),
        "files_scored": len(c.done), "files_left": left,
        "files_bad": len(job.bad), "rows_not_scored": sum(b["rows"] or 0 for b in job.bad), "bad_files": job.bad,
        "rows": c.rows, "errors": c.errors, "error_kinds": dict(c.error_kinds.most_common(10)),
        "tokens": c.tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(c.tokens / seconds, 1) if seconds > 0 else None,
        "rows_per_s": round(c.rows / seconds, 1) if seconds > 0 else None,
        "seconds_to_first_batch": round(c.t_first - c.t0, 3) if c.t_first else None,
        "seconds_to_scorers_ready": round(ready - c.wall0, 3) if ready else None,
        "tokens_per_s_after_ready": round(c.tokens / after_ready, 1) if after_ready else None,
        "actors": len(actor_ids), "actor_processes": len(reports),
        "actor_restarts": len(reports) - len(actor_ids),
        "gpus": plan.get("gpus", 0), "gpu_ids": gpu_ids,
        "backend": sorted({st.get("backend") for st in reports}),
        "devices": sorted({st.get("device") for st in reports}),
        "budgets": sorted({st.get("budget") for st in reports}),
        "budget_history": {k: st["stats"]["budget_history"] for k, st in scorers.items()},
        "oom_retries": sum(s["oom_retries"] for s in scored),
        "scorer_rows": sum(s["rows"] for s in scored), "scorer_tokens": tok, "scorer_padded_tokens": padded,
        "padding_overhead": 0.0 if packed or not tok else round(padded / tok - 1.0, 4),
        "packed": packed,
        "forward_s": round(sum(s["forward_s"] for s in scored), 3),
        "warmup_s": sorted(round(s["warmup_s"], 3) for s in scored),
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("questions",)},
        "timeline": [[round(t, 3), r, k] for t, r, k in tl],
    }


def format_summary(s: dict) -> str:
    """The summary as a short human-readable block."""
    bad = s.get("bad_files") or []
    lines = [
        "offline scoring summary (%s)" % s["output"],
        "  files      %d scored, %d already done, %d left, %d bad (skipped), %d total" % (
            s["files_scored"], s["files_skipped_done"], s["files_left"], len(bad), s["input_files"]),
        "  rows       %d (%d errors%s)" % (s["rows"], s["errors"], (": " + ", ".join(
            "%s %d" % kv for kv in s["error_kinds"].items())) if s["error_kinds"] else ""),
        "  tokens     %d in %.1f s = %s tokens/s (%s rows/s); %s tokens/s after the scorers were ready (%s s)" % (
            s["tokens"], s["seconds"], s["tokens_per_s"], s["rows_per_s"], s["tokens_per_s_after_ready"],
            s["seconds_to_scorers_ready"]),
        "  scorers    %d actor(s) (%d restart(s)), %d GPU(s) %s, backend %s, device %s" % (
            s["actors"], s["actor_restarts"], s["gpus"], s["gpu_ids"] or "", ",".join(map(str, s["backend"])),
            ",".join(map(str, s["devices"]))),
        "  batching   token budget(s) %s, OOM retries %d, padding overhead %.1f%%%s, forward %.1f s" % (
            s["budgets"], s["oom_retries"], 100 * s["padding_overhead"], " (packed)" if s["packed"] else "",
            s["forward_s"]),
    ]
    if bad:  # rows of a file whose footer cannot be read are not known
        lines.insert(2, "  skipped    %d bad file(s), %d rows not scored: %s" % (
            len(bad), s["rows_not_scored"], "; ".join(b["reason"] for b in bad[:5])))
    return "\n".join(lines)
