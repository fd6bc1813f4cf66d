"""`--min-confidence` of the offline job: the value checked before any data or Ray, the abstention columns the
gate adds after the unchanged ones, in-process and on a real Ray Data pipeline, equal to Engine.predict_batch's
gate (and so upstream's: tests/test_abstention.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from serve_app import offline
from serve_app.offline.config import JobSpec
from serve_app.offline.decode import DecodeStage
from serve_app.offline.driver import prepare_job
from serve_app.offline.schema import GATE_SUFFIXES
from serve_app.offline.score import ScoreStage
from serve_app.offline.tokenize import TokenizeStage
from tests.test_offline import (  # noqa: F401 - one_thread is a fixture
    QUESTIONS,
    _batch,
    _cli,
    expected_error,
    good_state,
    make_json_inputs,
    one_thread,
    write_questions,
)

GATE_KEYS = ("abstention", "abstention_threshold", "low_confidence")


def gate_of(answer: dict) -> tuple:
    """(abstention, abstention_threshold, low_confidence) as the offline columns hold them."""
    return answer["abstention"], answer["abstention_threshold"], answer.get("low_confidence", False)


def split_threshold(confidences: list[float]) -> float:
    """A threshold between two observed confidences near their median, at least 1e-3 from each (batch composition
    moves a confidence by far less), so some answers fall on each side and none sits on the edge."""
    c = sorted(set(confidences))
    mid = len(c) // 2
    for k in sorted(range(len(c) - 1), key=lambda j: abs(j - mid)):
        if c[k + 1] - c[k] > 2e-3:
            return (c[k] + c[k + 1]) / 2
    raise AssertionError("no gap between the observed confidences")


BAD_VALUES = [("1.5", "min_confidence must be a float in [0.0, 1.0], got 1.5"), ("nan", "got nan"),
              ("inf", "got inf"), ("high", "expected a number in [0.0, 1.0] or a JSON object"),
              ('{"choice:4": 0.5}', "min_confidence map keys must be a bucket like 'choice:3-5'"),
              ("{}", "a min_confidence map must be a non-empty dict"), ('{"noul:2": 0.5', "expected a number"),
              ('{"default": true}', "got True")]


@pytest.mark.parametrize("value,needle", BAD_VALUES, ids=[v for v, _ in BAD_VALUES])
def test_a_bad_min_confidence_exits_2_before_anything_runs(tmp_path, capsys, tiny_checkpoint, value, needle,
                                                          monkeypatch):
    """Refused by the flag's parser with upstream's text: no input is read (it does not exist), no Ray starts."""
    from serve_app.offline import driver

    inits = []  # the driver attaching to or starting Ray (a session-wide Ray of other modules may be up)
    real_init = driver.init_ray
    monkeypatch.setattr(driver, "init_ray", lambda *a, **k: inits.append(a) or real_init(*a, **k))
    qf = write_questions(tmp_path, QUESTIONS)
    with pytest.raises(SystemExit) as exit_:
        _cli(tmp_path, qf, tiny_checkpoint, "--min-confidence", value)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --min-confidence" in err and needle in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and inits == []


@pytest.mark.parametrize("value", [2, -0.5, True, "0.5", {"choice:9": 0.1}, {"default": None}])
def test_a_bad_typed_config_value_is_a_config_error(tmp_path, tiny_checkpoint, value):
    """`OfflineConfig(min_confidence=...)` built in code is checked by `prepare_job`, before inputs or Ray."""
    cfg = offline.OfflineConfig(input=[str(tmp_path / "missing")], output=str(tmp_path / "out"),
                                questions=write_questions(tmp_path, QUESTIONS), state_column="s",
                                checkpoint=tiny_checkpoint, min_confidence=value)
    with pytest.raises(offline.ConfigError, match="^--min-confidence: .*min_confidence"):
        prepare_job(cfg)


def test_help_documents_the_flag():
    text = offline.parser().format_help()
    assert "--min-confidence" in text and "_abstention" in text and "choice:3-5" in text


@pytest.mark.usefixtures("one_thread")
def test_gated_stages_add_columns_equal_to_predict_batch(tiny_checkpoint, engine):
    """tokenize -> score -> decode with a number and with a per-bucket map: the ungated columns are unchanged (same
    names, order, types and values as an ungated job's), and the abstention columns follow them, equal to
    Engine.predict_batch(min_confidence=...); a row that failed has nulls there."""
    rng = random.Random(9)
    states = [good_state(rng, i) for i in range(12)]
    cells = [json.dumps(s) for s in states] + [None]
    plain_spec = JobSpec(checkpoint=tiny_checkpoint, questions_json=json.dumps(QUESTIONS), state_column="state",
                         carry_columns=("id",), json_state=True, max_len=160)
    scored = ScoreStage(plain_spec, {"backend": "eager", "device": "cpu", "max_batch_rows": 1}, cpus=1)(
        TokenizeStage(plain_spec)(_batch("/x/in.parquet", cells)))
    plain = DecodeStage(plain_spec)(scored)
    refs = engine.predict_batch(states, QUESTIONS, max_len=160)
    thr = split_threshold([a["answer_confidence"] for r in refs for a in r["answers"].values()])
    bucket_map = {"choice:3-5": thr, "noul:2": 0.99, "default": 0.01}
    seen = set()
    for threshold in (thr, bucket_map):
        spec = dataclasses.replace(plain_spec, min_confidence_json=json.dumps(threshold))
        gated = DecodeStage(spec)(scored)
        n_plain = len(plain.column_names) - 2  # without __path, __row (last)
        assert gated.column_names[:n_plain] == plain.column_names[:n_plain]
        assert gated.select(plain.column_names).equals(plain)
        added = gated.column_names[n_plain:-2]
        assert added == [q + s for q in QUESTIONS for s in GATE_SUFFIXES]
        assert [gated.schema.field(c).type for c in added[:3]] == [pa.string(), pa.float64(), pa.bool_()]
        rows = gated.to_pylist()
        want = engine.predict_batch(states, QUESTIONS, max_len=160, min_confidence=threshold)
        for row, ref in zip(rows, want):
            for qid, a in ref["answers"].items():
                got = tuple(row[qid + s] for s in GATE_SUFFIXES)
                assert got == gate_of(a), (qid, got, a)
                seen.add(got[0])
        assert all(rows[-1][c] is None for c in added) and rows[-1]["error"] == "state is null"
    assert seen == {"passed", "abstained"}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_min_confidence_on_a_ray_data_pipeline(cluster, tmp_path, tiny_checkpoint, engine):
    """The CLI on a real local Ray cluster with a per-bucket map: every row of every file, the ungated schema as a
    prefix of the output schema, the abstention columns equal to Engine.predict_batch's gate."""
    from tests.test_offline_ray import QUESTIONS as QS

    paths = make_json_inputs(str(tmp_path / "in"), sizes=(30, 0))
    states = [json.loads(c) for c in pq.read_table(paths[0]).column("state_json").to_pylist()
              if expected_error(c) is None]
    refs = engine.predict_batch(states, QS, max_len=128)
    thr = split_threshold([a["answer_confidence"] for r in refs for a in r["answers"].values()])
    bucket_map = {"choice:3-5": thr, "default": thr}
    qf = write_questions(tmp_path, QS)
    args = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--questions", qf,
            "--state-column", "state_json", "--json-state", "--id-column", "id", "--checkpoint", tiny_checkpoint,
            "--max-len", "128", "--num-gpus", "0", "--num-actors", "1", "--batch-size", "8", "--no-ray-progress",
            "--address", cluster["gcs"], "-q"]
    assert offline.main(args + ["--min-confidence", json.dumps(bucket_map)]) == 0
    flags = {k: v for k, v in vars(offline.parser().parse_args(args)).items() if k not in ("quiet", "summary_json")}
    ungated = prepare_job(offline.OfflineConfig(**flags))
    out = pq.read_table(str(tmp_path / "out" / "part-00.parquet"))
    from serve_app.offline.write import output_schema

    plain_schema = output_schema(ungated.files[0], ungated)
    assert out.schema.names[:len(plain_schema)] == plain_schema.names
    assert out.schema.names[len(plain_schema):] == [q + s for q in QS for s in GATE_SUFFIXES]
    assert pq.read_table(str(tmp_path / "out" / "part-01.parquet")).num_rows == 0
    cells = pq.read_table(paths[0]).column("state_json").to_pylist()
    rows = [r for r, c in zip(out.to_pylist(), cells) if expected_error(c) is None]
    want = engine.predict_batch(states, QS, max_len=128, min_confidence=bucket_map)
    seen = set()
    for row, ref in zip(rows, want):
        for qid, a in ref["answers"].items():
            assert tuple(row[qid + s] for s in GATE_SUFFIXES) == gate_of(a)
            seen.add(a["abstention"])
    assert seen == {"passed", "abstained"} and len(rows) == len(states) < out.num_rows
    # a re-run with another threshold is another job: refused, not mixed into these outputs
    assert offline.main(args + ["--min-confidence", "0.5"]) == 2
    assert os.path.exists(str(tmp_path / "out" / "part-00.parquet"))
