"""Sizing the offline job from a sample of its own rows: how many CPU tasks tokenize and decode, and which row
lengths the scorer's warm-up probe measures.

Before Ray starts, the driver runs the three stages' CPU work over up to `SAMPLE_STATES` states of the first input
file: the tokenize stage, the score stage's row building, and the decode stage on zero logits. Each costs CPU
seconds per scored token (process CPU time for tokenizing, whose tokenizer may run several threads; thread CPU
time for decoding, which runs on one). A pool of single-CPU tasks keeps a scorer actor fed when it has `HEADROOM`
times the tokens/s of that actor's forward, the forward taken at `FORWARD_TOKENS_PER_S` (for a GPU: above what an
H200 reaches in bf16, so a faster forward still finds enough tasks). The pools stay within the CPUs the scorer
actors leave, minus one for the driver and the reads, so CPU stages never crowd out the GPU actors' host threads.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .config import Job
from .decode import DecodeStage
from .io import InputFile
from .schema import RAY_PATH, RAY_ROW_HASH, job_codec
from .score import build_rows, scored_table
from .tokenize import TokenizeStage

SAMPLE_STATES = 512
PROBE_LENGTHS = 2048     # row lengths shipped to the scorer actors for their probe
FORWARD_TOKENS_PER_S = {"gpu": 1.5e6, "cpu": 1e5}
HEADROOM = 2.0
# CPU seconds per scored token when the sample tells nothing (every state an error): a slow tokenizer's
DEFAULT_TOKENIZE_TOKENS_PER_CPU_S = 5e5
DEFAULT_DECODE_TOKENS_PER_CPU_S = 2e6


@dataclass
class Sample:
    """What the sample measured: states, their rows and scored tokens, CPU seconds per stage, the row lengths."""

    states: int = 0
    rows: int = 0
    tokens: int = 0
    tokenize_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0
    seconds: float = 0.0
    row_lengths: list[int] = field(default_factory=list)

    def rate(self, cpu_s: float) -> float | None:
        """Scored tokens per CPU second of a stage that took `cpu_s`, or None when the sample has no tokens."""
        return self.tokens / cpu_s if self.tokens and cpu_s > 0 else None

    def as_dict(self) -> dict:
        """A JSON-friendly summary (the row lengths as a count and a mean)."""
        return {"states": self.states, "rows": self.rows, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "tokenize_tokens_per_cpu_s": _round(self.rate(self.tokenize_cpu_s)),
                "decode_tokens_per_cpu_s": _round(self.rate(self.decode_cpu_s)),
                "mean_row_tokens": round(self.tokens / self.rows, 1) if self.rows else None}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v)


def read_sample(job: Job, f: InputFile, n: int) -> pa.Table:
    """The first `n` rows of `f`'s state and carried columns, with the two columns Ray's reader adds."""
    columns = list(dict.fromkeys([job.spec.state_column, *job.spec.carry_columns]))
    with job.fs.open_input_file(f.path) as fh:
        batch = next(pq.ParquetFile(fh).iter_batches(batch_size=n, columns=columns), None)
    t = pa.Table.from_batches([batch]) if batch is not None else pa.table({c: pa.array([]) for c in columns})
    # the row positions `TokenizeStage` recovers from these are not used: only costs and lengths are
    return (t.append_column(RAY_PATH, pa.array([f.path] * t.num_rows, pa.string()))
            .append_column(RAY_ROW_HASH, pa.array(np.zeros(t.num_rows, np.int64))))


def take_sample(job: Job, files: list[InputFile], n: int = SAMPLE_STATES) -> Sample:
    """Run the stages' CPU work over up to `n` states of the first of `files` (see the module docstring)."""
    t0 = time.perf_counter()
    table = read_sample(job, files[0], n)
    tok = TokenizeStage(job.spec)
    codec, prepared = job_codec(job.spec)
    tok(table.slice(0, 8))  # tokenizer and heads warmed up outside the timed part
    c = time.process_time()
    tokenized = tok(table)
    rows, per_state, errors = build_rows(tokenized, codec, prepared)
    c_tok = time.process_time() - c
    nq, kmax = len(prepared.questions), prepared.kmax
    zeros = np.zeros((len(rows), kmax), np.float32), np.zeros(len(rows), np.float32)
    scored = scored_table(tokenized, errors, per_state, *zeros, nq, kmax)
    dec = DecodeStage(job.spec)
    dec(scored.slice(0, 8))
    c = time.thread_time()  # decoding runs on this thread alone: other threads' CPU is not its cost
    dec(scored)
    c_dec = time.thread_time() - c
    lengths = [len(r) for r in rows]
    return Sample(states=table.num_rows, rows=len(rows), tokens=sum(lengths), tokenize_cpu_s=c_tok,
                  decode_cpu_s=c_dec, seconds=time.perf_counter() - t0, row_lengths=lengths[:PROBE_LENGTHS])


def stage_tasks(actors: int, gpu: bool, sample: Sample | None, cluster_cpus: float, actor_cpus: float,
                tokenize: int | None = None, decode: int | None = None) -> dict:
    """Tasks for the tokenize and decode pools (explicit counts win), and the numbers they came from.

    Each pool gets HEADROOM x the actors' forward tokens/s over its tokens per CPU second, at least one task, and
    together they stay within the CPUs left after the actors and one for the driver and reads (tokenize first).
    """
    forward = actors * FORWARD_TOKENS_PER_S["gpu" if gpu else "cpu"]
    tok_rate = (sample.rate(sample.tokenize_cpu_s) if sample else None) or DEFAULT_TOKENIZE_TOKENS_PER_CPU_S
    dec_rate = (sample.rate(sample.decode_cpu_s) if sample else None) or DEFAULT_DECODE_TOKENS_PER_CPU_S
    spare = max(1, int(cluster_cpus - actors * actor_cpus - 1))
    need_tok = math.ceil(HEADROOM * forward / tok_rate)
    need_dec = math.ceil(HEADROOM * forward / dec_rate)
    n_tok = tokenize or max(1, min(need_tok, spare - 1))
    n_dec = decode or max(1, min(need_dec, spare - n_tok))
    return {"tokenize_tasks": int(n_tok), "decode_tasks": int(n_dec), "tokenize_tasks_needed": need_tok,
            "decode_tasks_needed": need_dec, "spare_cpus": spare, "forward_tokens_per_s_assumed": forward,
            "tokenize_tokens_per_cpu_s": round(tok_rate), "decode_tokens_per_cpu_s": round(dec_rate)}
