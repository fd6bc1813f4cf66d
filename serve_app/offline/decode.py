"""Stage 3, CPU tasks: turn each scored state's logits into its answer columns with the weightless codec."""

from __future__ import annotations

import pyarrow as pa

from model import abstention

from .config import JobSpec
from .schema import (
    C_ACT,
    C_ERROR,
    C_LOGITS,
    C_PATH,
    C_ROW,
    C_TOKENS,
    C_TRUNC,
    OUT_ERROR,
    OUT_TOKENS,
    OUT_TRUNC,
    Stage,
    gate_fields,
    job_codec,
    list_values,
    output_fields,
)
from .score import ScoreStage
from .tokenize import TokenizeStage


class DecodeStage(Stage):
    """Scored batch -> the output columns plus the row's file and position (`__path`, `__row`).

    The output columns are the carried ones, four per question (`output_fields`), then the `ADDS` columns, then
    for a gated job (`spec.min_confidence`) each question's abstention columns, as upstream's gate writes them.
    """

    ADDS = {OUT_TOKENS: "input tokens over the state's rows", OUT_TRUNC: "the state was cut to fit max_len",
            OUT_ERROR: "null when the row scored; else the reason"}
    DROPS = (C_LOGITS, C_ACT, C_TOKENS, C_TRUNC, C_ERROR)

    def __init__(self, spec: JobSpec):
        self.spec = spec

    def requires(self) -> dict[str, str]:
        """The carried columns, the score stage's outputs and the tokenize stage's usage and position."""
        need = {c: "copied to the output" for c in self.spec.carry_columns}
        need.update({c: ScoreStage.ADDS[c] for c in (C_LOGITS, C_ACT, C_ERROR)})
        need.update({c: TokenizeStage.ADDS[c] for c in (C_TOKENS, C_TRUNC, C_PATH, C_ROW)})
        return need

    def __call__(self, batch: pa.Table) -> pa.Table:
        """The output columns of `batch` in output order, then `__path` and `__row` for the driver."""
        self.check(batch)
        codec, prepared = job_codec(self.spec)
        n, nq, kmax = batch.num_rows, len(prepared.questions), prepared.kmax
        errors = batch.column(C_ERROR).to_pylist()
        lg_vals, lg_off = list_values(batch.column(C_LOGITS))
        act_vals, act_off = list_values(batch.column(C_ACT))
        fields = output_fields(prepared)[:len(prepared.column_names)]
        data: dict[str, list] = {f.name: [None] * n for f in fields}
        threshold = self.spec.min_confidence
        gated = [] if threshold is None else gate_fields(prepared)
        data.update({f.name: [None] * n for f in gated})
        for i in range(n):
            if errors[i] is not None:
                continue
            lg = lg_vals[lg_off[i]:lg_off[i + 1]].reshape(nq, kmax)
            ap = act_vals[act_off[i]:act_off[i + 1]]
            row = codec.decode_columns(prepared, lg, ap)
            for name, v in row.items():
                data[name][i] = v
            if gated:
                for name, q in zip(prepared.names, prepared.questions):
                    gate_row(data, i, name, q.qtype, row, threshold)
        cols = {c: batch.column(c) for c in self.spec.carry_columns}
        for f in fields:
            cols[f.name] = pa.array(data[f.name], f.type)
        cols[OUT_TOKENS] = batch.column(C_TOKENS)
        cols[OUT_TRUNC] = batch.column(C_TRUNC)
        cols[OUT_ERROR] = batch.column(C_ERROR)
        for f in gated:
            cols[f.name] = pa.array(data[f.name], f.type)
        for c in (C_PATH, C_ROW):
            cols[c] = batch.column(c)
        return pa.table(cols)


def gate_row(data: dict[str, list], i: int, name: str, qtype: str, row: dict, threshold) -> None:
    """Fill row `i` of question `name`'s abstention columns in `data` from its decoded columns `row`: the gate
    applied to the answer those columns describe (its type, answer confidence and options)."""
    answer = {"type": qtype, "answer_confidence": row[name + "_answer_confidence"],
              "probabilities": dict(row[name + "_probabilities"])}
    state = abstention.gate_answer(answer, threshold)
    data[name + "_abstention"][i] = state
    data[name + "_abstention_threshold"][i] = answer["abstention_threshold"]
    data[name + "_low_confidence"][i] = state == abstention.ABSTAINED
