"""The run summary: the collector's counts and the scorer actors' reports, as JSON and as a short text block."""

from __future__ import annotations

import time
from dataclasses import asdict

from .config import Job, OfflineConfig
from .io import InputFile, OutputDir
from .write import Collector

# (key, label) of the start-up pieces in the order they happen; together they make up `total_s`
PIECES = (("prepare_s", "job checks"), ("sample_s", "sample"), ("ray_init_s", "Ray"), ("pipeline_s", "pipeline"),
          ("actor_start_s", "actor start"), ("actor_import_s", "imports"), ("model_load_s", "model"),
          ("kernel_load_s", "kernels"), ("budget_probe_s", "budget probe"), ("warmup_s", "warm-up"),
          ("actor_other_s", "other"))


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def startup(marks: dict[str, float] | None, reports: list[dict], first_batch_at: float | None) -> dict | None:
    """Where the start-up went, piece by piece (`PIECES`), from the driver's wall-clock marks and the report of
    the first scorer actor ready; `total_s` is run start to that actor ready, `first_batch_s` from then to the
    first scored batch back at the driver. None when no scorer started."""
    ready = [st for st in reports if st.get("ready_at") and st.get("started")]
    if not marks or "built" not in marks or not ready:
        return None
    st = min(ready, key=lambda r: r["ready_at"])
    began, su = st["started"], st.get("startup") or {}
    kernels = su.get("kernels_s") or 0.0
    load = su.get("load_s") or 0.0
    # a worker that imported the package before it became this actor (an earlier task) counts no imports here
    imports_from = min(max(began.get("import_began_at") or began["entered_at"], marks["built"]), began["entered_at"])
    actor = st["ready_at"] - began["entered_at"]
    inside = began["import_s"] + load + (su.get("probe_s") or 0.0) + (su.get("warmup_s") or 0.0)
    out = {"prepare_s": marks["prepared"] - marks["start"], "sample_s": marks["sampled"] - marks["prepared"],
           "ray_init_s": marks["ray_up"] - marks["sampled"], "pipeline_s": marks["built"] - marks["ray_up"],
           "actor_start_s": imports_from - marks["built"],
           "actor_import_s": began["entered_at"] - imports_from + began["import_s"],
           "model_load_s": load - kernels, "kernel_load_s": kernels, "budget_probe_s": su.get("probe_s"),
           "warmup_s": su.get("warmup_s"), "actor_other_s": actor - inside,
           "graph_capture_s": su.get("capture_s"),
           "actor_process_age_s": (began["entered_at"] - began["process_at"]) if began.get("process_at") else None,
           "total_s": st["ready_at"] - marks["start"],
           "first_batch_s": (first_batch_at - st["ready_at"]) if first_batch_at else None,
           "actors_ready_s": sorted(_r(r["ready_at"] - marks["start"]) for r in ready)}
    return {k: v if isinstance(v, list) else _r(v) for k, v in out.items()}


def summarize(cfg: OfflineConfig, job: Job, out: OutputDir, done: list[InputFile], pending: list[InputFile],
              c: Collector, scorers: dict[str, dict], plan: dict, seconds: float,
              marks: dict[str, float] | None = None) -> dict:
    """The run summary: rows, errors, tokens, time, throughput, GPUs, budgets, padding overhead, start-up pieces,
    the CPU pools' sizes.

    `scorers` maps "actor id/pid" to that scorer process's last report (`ScoreStage.stats`); `marks` are the
    driver's wall-clock start-up marks (`driver.run`).
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
    first_at = c.wall0 + (c.t_first - c.t0) if c.t_first else None
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
        "budget_probe": {k: st["stats"].get("budget_probe") for k, st in scorers.items()},
        "startup": startup(marks, reports, first_at),
        "stages": plan.get("stages"), "sample": plan.get("sample"),
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
    su = s.get("startup")
    if su:
        parts = ", ".join("%s %.1f" % (label, su[k]) for k, label in PIECES if su.get(k) is not None)
        lines.append("  start-up   %.1f s to the first scorer ready: %s; first batch %s s later" % (
            su["total_s"], parts, su["first_batch_s"]))
    st = s.get("stages")
    if st:
        lines.append("  CPU stages %d tokenize and %d decode task(s) (%s tokens/s per CPU tokenizing, %s decoding)" % (
            st["tokenize_tasks"], st["decode_tasks"], st["tokenize_tokens_per_cpu_s"], st["decode_tokens_per_cpu_s"]))
    if bad:  # rows of a file whose footer cannot be read are not known
        lines.insert(2, "  skipped    %d bad file(s), %d rows not scored: %s" % (
            len(bad), s["rows_not_scored"], "; ".join(b["reason"] for b in bad[:5])))
    return "\n".join(lines)
