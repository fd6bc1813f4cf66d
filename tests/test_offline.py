"""Offline scoring without a cluster: state handling, row positions, the three stages in-process, the CLI's checks.

The Ray tests (tests/test_offline_ray.py) run the same stages on a real local cluster; these pin down each
piece quickly and import the data helpers they share.
"""

from __future__ import annotations

import datetime
import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from serve_app import offline
from serve_app.offline.config import JobSpec
from serve_app.offline.decode import DecodeStage
from serve_app.offline.io import ConfigError, OutputDir, discover
from serve_app.offline.score import ScorerReports, ScoreStage
from serve_app.offline.tokenize import TokenizeStage, extract_state, row_index
from tests import cases

EXAMPLE_QUESTIONS = os.path.join(os.path.dirname(__file__), "..", "configs", "example_questions.json")
QUESTIONS = {  # every question type, labels of three kinds, a permuted option order
    "intent": {"type": "choice", "instructions": "What does the customer want?",
               "criteria": {"refund": "money back", "replacement": "a new item", "info": "just asking"}},
    "stars": {"type": "choice", "instructions": "How many stars?", "criteria": [1, 2, 3, 4, 5]},
    "flag": {"type": "choice", "instructions": "Flag?", "criteria": [True, "maybe", 2.5]},
    "order": {"type": "choice", "instructions": "Pick", "criteria": ["a", "b", "c", "d"], "option_order": [2, 0, 3, 1]},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["not", "somewhat", "very"]},
    "angry": {"type": "noul", "instructions": "Is the customer angry?", "labels": {"false": "calm", "true": "angry"}},
}


# -- data helpers shared with the Ray tests ------------------------------------------------------
def good_state(rng: random.Random, i: int):
    """A usable state: text, JSON object or conversation, some long enough to be truncated."""
    kind = ("text", "dict", "list")[i % 3]
    return cases.state(rng, kind, long=(i % 11 == 4))


BAD = [  # (cell in a JSON-string column, reason the row must carry)
    (None, "state is null"),
    ("", "state is empty"),
    ("   ", "state is empty"),
    ("{bad json", "state is not valid JSON"),
    ("42", "state JSON must be an object, array or string"),
    ("[]", "state is empty"),
    (json.dumps({"blob": "x " * 20000}), "state too large"),
]


def make_json_inputs(d: str, sizes=(60, 45, 0), seed=0, row_group_size=16) -> list[str]:
    """Parquet files with an id, a JSON-string state column (some cells bad) and a passthrough column.

    Returns the file paths. Bad cells are spread so every file of 20+ rows has each kind once.
    """
    rng = random.Random(seed)
    os.makedirs(d, exist_ok=True)
    paths = []
    for fi, n in enumerate(sizes):
        ids, states, extra = [], [], []
        for i in range(n):
            ids.append("f%d-%04d" % (fi, i))
            if i % 9 == 4 and (i // 9) < len(BAD):
                states.append(BAD[i // 9][0])
            else:
                states.append(json.dumps(good_state(rng, i), ensure_ascii=False))
            extra.append(float(i) / 2)
        t = pa.table({"id": pa.array(ids, pa.string()), "state_json": pa.array(states, pa.string()),
                      "score_in": pa.array(extra, pa.float64()), "unused": pa.array([b"x" * 64] * n, pa.binary())})
        p = os.path.join(d, "part-%02d.parquet" % fi)
        pq.write_table(t, p, row_group_size=row_group_size)
        paths.append(p)
    return paths


def expected_error(cell) -> str | None:
    """The reason a JSON-string cell must produce, or None for a good one."""
    for c, reason in BAD:
        if c == cell:
            return reason
    return None


def answer_columns(row: dict, ref: dict, questions: dict) -> list[tuple[str, object, object]]:
    """(column, offline value, predict_batch value) pairs for one row."""
    out = []
    for qid, q in questions.items():
        a = ref["answers"][qid]
        if q["type"] == "choice":
            out.append((qid, row[qid], a["choice"]))
            probs = {offline_key(k): v for k, v in a["probabilities"].items()}
        elif q["type"] == "score":
            out.append((qid, row[qid], a["score"]))
            probs = a["probabilities"]
        else:
            out.append((qid, row[qid], a["noul"]))
            probs = {"false": round(1 - a["noul"], 4), "true": a["noul"]}
        out += [(qid + "_confidence", row[qid + "_confidence"], a["confidence"]),
                (qid + "_answer_confidence", row[qid + "_answer_confidence"], a["answer_confidence"]),
                (qid + "_probabilities", dict(row[qid + "_probabilities"]), probs)]
    out += [("input_tokens", row["input_tokens"], ref["usage"]["input_tokens"]),
            ("truncated", row["truncated"], ref["usage"]["truncated"])]
    return out


def offline_key(k) -> str:
    return k if isinstance(k, str) else json.dumps(k)


def compare_to_reference(rows: list[dict], refs: list[dict], questions: dict, tol: float = 0.0) -> dict:
    """Assert each row equals its reference answer (floats within `tol`); returns counts of what was checked.

    With tol > 0 a label may differ only where the reference's top two probabilities are within 2*tol. Answers carry
    4 decimals (model/decode.py rounds them), so with tol > 0 two values that were within tol before rounding may be
    one unit of the fourth decimal further apart after it (0.52775 and 0.52774 round to 0.5278 and 0.5277).
    """
    slack = tol + 1e-4 + 1e-9 if tol > 0 else 0.0
    checked = {"rows": 0, "values": 0, "close_labels": 0}
    choice = {qid for qid, q in questions.items() if q["type"] == "choice"}
    for row, ref in zip(rows, refs):
        checked["rows"] += 1
        for col, got, want in answer_columns(row, ref, questions):
            checked["values"] += 1
            if isinstance(want, dict):
                assert set(got) == set(want), col
                for k in want:
                    assert abs(got[k] - want[k]) <= slack, (col, k, got, want)
            elif col in choice:
                if offline_key(got) != offline_key(want):
                    top = sorted(ref["answers"][col]["probabilities"].values())[-2:]
                    assert tol > 0 and top[1] - top[0] <= 2 * tol, (col, got, want, top)
                    checked["close_labels"] += 1
            elif isinstance(want, float):
                assert abs(got - want) <= slack, (col, got, want)
            else:
                assert got == want, (col, got, want)
    return checked


def ray_row_hashes(path: str, n: int) -> np.ndarray:
    """What Ray's read_parquet(include_row_hash=True) writes for rows 0..n-1 of `path`."""
    from ray.data._internal.datasource_v2.common.synthesized_columns import _compute_row_hashes

    return _compute_row_hashes(path, 0, n)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (like a 1-CPU scorer actor; far faster than 2 on a busy 2-core box)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_questions(d, questions) -> str:
    p = os.path.join(str(d), "questions.json")
    with open(p, "w") as fh:
        json.dump(questions, fh)
    return p


# -- pieces -------------------------------------------------------------------------------------
def test_row_index_inverts_ray_row_hash():
    for path, n in (("/data/in/part-0.parquet", 5000), ("bucket/key with space/é.parquet", 17)):
        h = ray_row_hashes(path, n)
        assert row_index([path] * n, h).tolist() == list(range(n))
    # rows of two files interleaved, and a wrong path gives positions far out of range
    a, b = ray_row_hashes("/a.parquet", 10), ray_row_hashes("/b.parquet", 10)
    mixed = np.concatenate([a[5:], b[:5]])
    assert row_index(["/a.parquet"] * 5 + ["/b.parquet"] * 5, mixed).tolist() == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    assert not (0 <= row_index(["/b.parquet"], a[:1])[0] < 10**9)


@pytest.mark.parametrize("cell,json_state,expect", [
    (None, False, "state is null"), ("", False, "state is empty"), (" \n", False, "state is empty"),
    ("hello", False, None), ("{\"a\": 1}", False, None), ("{bad", True, "state is not valid JSON"),
    ("true", True, "state JSON must be an object, array or string"), ("\"\"", True, "state is empty"),
    ("\"text\"", True, None), ("[1, 2]", True, None), ("{}", True, "state is empty"),
    ({}, False, "state is empty"), ({"a": None}, False, None), ([], False, "state is empty"),
    (b"\xff\xfe", False, "state is not valid UTF-8"), (b"bytes ok", False, None), (7, False, "state must be text"),
    ("x" * 51, False, "state too large"), ("[\"" + "x" * 60 + "\"]", True, "state too large"),
])
def test_extract_state(cell, json_state, expect):
    state, text, err = extract_state(cell, json_state, max_chars=50)
    if expect is None:
        assert err is None and text is not None
    else:
        assert err is not None and err.startswith(expect) and state is None


def test_struct_values_become_json():
    d = datetime.datetime(2026, 1, 2, 3, 4, 5)
    state, text, err = extract_state({"when": d, "n": 1, "tags": ["a"]}, False, 0)
    assert err is None and json.loads(text) == {"when": d.isoformat(), "n": 1, "tags": ["a"]}


def test_discover_dirs_globs_and_relative_names(tmp_path):
    for sub in ("a", "b/c"):
        (tmp_path / sub).mkdir(parents=True)
        pq.write_table(pa.table({"x": [1]}), tmp_path / sub / "p.parquet")
    (tmp_path / "a" / "_SUCCESS").write_text("")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "a" / "_tmp.parquet")
    _, files = discover([str(tmp_path)])
    assert [f.rel for f in files] == ["a/p.parquet", "b/c/p.parquet"]
    _, files = discover([str(tmp_path / "*" / "*.parquet")])
    assert [f.rel for f in files] == ["_tmp.parquet", "p.parquet"]  # a glob takes what it names
    _, files = discover([str(tmp_path / "b" / "c" / "p.parquet"), str(tmp_path / "b")])
    assert len(files) == 1 and files[0].rel == "p.parquet"
    _, files = discover([str(tmp_path)], exclude=str(tmp_path / "b"))  # an output dir inside the input dir
    assert [f.rel for f in files] == ["p.parquet"]
    with pytest.raises(ConfigError, match="does not exist"):
        discover([str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="matches no Parquet"):
        discover([str(tmp_path / "*.csv")])


def _batch(path: str, cells: list, column: str = "state", typ=None) -> pa.Table:
    n = len(cells)
    return pa.table({"id": pa.array(range(n), pa.int64()), column: pa.array(cells, typ),
                     "path": pa.array([path] * n), "row_hash": pa.array(ray_row_hashes(path, n), pa.uint64())})


def test_stages_in_process_equal_predict_batch(tiny_checkpoint, engine, one_thread):
    """tokenize -> ScoreStage -> decode on one batch equals Engine.predict_batch row by row.

    With one row per forward (max_batch_rows=1) on both sides the values are identical, not just close:
    batch composition is the only source of difference between the two paths.
    """
    rng = random.Random(3)
    states = [good_state(rng, i) for i in range(15)]
    cells = [json.dumps(s) for s in states] + [None, "{oops"]
    spec = JobSpec(checkpoint=tiny_checkpoint, questions_json=json.dumps(QUESTIONS), state_column="state",
                   carry_columns=("id",), json_state=True, max_len=160)
    tok = TokenizeStage(spec)(_batch("/x/in.parquet", cells))
    assert tok.column("__row").to_pylist() == list(range(len(cells)))
    stage = ScoreStage(spec, {"backend": "eager", "device": "cpu", "max_batch_rows": 1}, cpus=1)
    scored = stage(tok)
    out = DecodeStage(spec)(scored).to_pylist()
    assert [r["error"] for r in out[-2:]] == ["state is null", out[-1]["error"]]
    assert out[-1]["error"].startswith("state is not valid JSON")
    assert all(r["stars"] is None and r["input_tokens"] is None for r in out[-2:])
    prepared = engine.prepare(QUESTIONS, max_len=160)
    from model.decode import result

    refs = []
    for s in states:  # the reference scored one row at a time, like the stage
        enc = engine.encode(s, prepared)
        lg = [engine.score([r]) for r in enc.rows]
        kmax = max(x[0].shape[1] for x in lg)
        logits = np.full((len(lg), kmax), -1e4, np.float32)
        for j, (lj, _) in enumerate(lg):
            logits[j, :lj.shape[1]] = lj[0]
        refs.append(result(prepared.questions, prepared.heads, enc, logits, np.array([a[0] for _, a in lg]),
                           engine.temperatures))
    checked = compare_to_reference(out[:15], refs, QUESTIONS, tol=0.0)
    assert checked["rows"] == 15 and checked["close_labels"] == 0
    assert any(r["truncated"] for r in out[:15]) and not all(r["truncated"] for r in out[:15])
    # and against predict_batch (one forward over all rows): same labels, values within float noise
    batch_refs = engine.predict_batch(states, QUESTIONS, max_len=160)
    compare_to_reference(out[:15], batch_refs, QUESTIONS, tol=1e-4)
    # value column types follow the labels
    t = DecodeStage(spec)(scored)
    assert (t.schema.field("stars").type, t.schema.field("flag").type, t.schema.field("intent").type) == (
        pa.int64(), pa.string(), pa.string())
    assert {r["flag"] for r in out[:15]} <= {"true", "maybe", "2.5"}
    info = stage.stats()
    assert info["stats"]["batches"] == info["stats"]["rows"] == 15 * len(QUESTIONS)
    # statistics travel through stage.stats(), not the data: the only internal columns left route rows to files
    assert [c for c in t.column_names if c.startswith("__")] == ["__path", "__row"]


def test_scorer_reports_keep_the_latest_report_of_each_process():
    reports = ScorerReports()
    for pid, rows in ((1, 5), (1, 3), (2, 1)):  # a late, smaller report of pid 1; pid 2 is a restart
        reports.report({"actor": "a", "pid": pid, "stats": {"rows": rows}})
    assert {k: v["stats"]["rows"] for k, v in reports.all().items()} == {"a/1": 5, "a/2": 1}


def test_struct_and_conversation_columns(tiny_checkpoint, engine, one_thread):
    """States from a struct column and from a list<struct> (conversation) column answer like the dicts/lists."""
    rng = random.Random(5)
    convs = [cases.state(rng, "list", long=(i == 1)) for i in range(4)]
    structs = [{"subject": cases.text(rng, 3), "body": cases.text(rng, 30), "n": i} for i in range(4)]
    for cells, col in ((convs + [None], "conv"), (structs + [None], "doc")):
        spec = JobSpec(checkpoint=tiny_checkpoint, questions_json=json.dumps(QUESTIONS), state_column=col,
                       carry_columns=("id",), max_len=128)
        batch = _batch("/x/%s.parquet" % col, cells, column=col)
        assert not pa.types.is_string(batch.schema.field(col).type)
        stage = ScoreStage(spec, {"backend": "eager", "device": "cpu"}, cpus=1)
        out = DecodeStage(spec)(stage(TokenizeStage(spec)(batch))).to_pylist()
        assert out[-1]["error"] == "state is null"
        refs = engine.predict_batch(cells[:-1], QUESTIONS, max_len=128)
        compare_to_reference(out[:-1], refs, QUESTIONS, tol=1e-4)
        if col == "conv":
            assert out[1]["truncated"]  # a long conversation keeps its newest turns, like Engine.encode


def test_score_stage_isolates_a_failing_state(tiny_checkpoint, one_thread):
    """A forward that fails for one state marks that state, not the batch; OOM is left to the scorer."""
    spec = JobSpec(checkpoint=tiny_checkpoint, questions_json=json.dumps(QUESTIONS), state_column="state",
                   carry_columns=("id",), max_len=96)
    tok = TokenizeStage(spec)(_batch("/x/f.parquet", ["first", "poison", "third"]))
    stage = ScoreStage(spec, {"backend": "eager", "device": "cpu"}, cpus=1)
    real = stage.scorer.score_rows
    poison = stage.codec.encode("poison", stage.prepared).rows[0].ids

    def flaky(rows):
        if any(r.ids == poison for r in rows):
            raise RuntimeError("device assert")
        return real(rows)

    stage.scorer.score_rows = flaky
    out = DecodeStage(spec)(stage(tok)).to_pylist()
    assert [r["error"] for r in out] == [None, "scoring failed: device assert", None]
    assert out[0]["intent"] is not None and out[2]["intent"] is not None


# -- CLI checks that happen before any data is read ----------------------------------------------
def _cli(tmp_path, questions_file, *extra, inputs=None):
    return offline.main(["--input", *(inputs or [str(tmp_path / "missing-input")]), "--output", str(tmp_path / "out"),
                         "--questions", questions_file, "--state-column", "state_json", "--json-state",
                         "--checkpoint", extra[0], *extra[1:], "-q"])


@pytest.mark.parametrize("questions,needle", [
    ({"good": {"type": "noul", "instructions": "ok?"}, "bad": {"type": "score", "instructions": "?", "criteria": []}},
     "question 'bad': a score question needs at least one level"),
    ({"x": {"type": "choice", "instructions": "?", "criteria": {"a": "x" * 4000, "b": "y" * 4000,
                                                                  **{"c%d" % i: "z" for i in range(150)}}}},
     "question 'x': only"),
    ({"q": {"type": "multiple", "instructions": "?"}}, "question 'q': unknown type 'multiple'"),
    ([1, 2], "must hold a JSON object"),
    ("{not json", "is not valid JSON"),
])
def test_malformed_questions_exit_2_before_reading_data(tmp_path, capsys, tiny_checkpoint, questions, needle):
    qf = str(tmp_path / "q.json")
    with open(qf, "w") as fh:
        fh.write(questions if isinstance(questions, str) else json.dumps(questions))
    # the input does not even exist: the questions are checked first
    assert _cli(tmp_path, qf, tiny_checkpoint) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and "missing-input" not in err
    assert not (tmp_path / "out").exists()


def test_bad_columns_and_other_jobs_exit_2(tmp_path, capsys, tiny_checkpoint):
    paths = make_json_inputs(str(tmp_path / "in"), sizes=(3,))
    qf = write_questions(tmp_path, json.loads(open(EXAMPLE_QUESTIONS).read()))
    assert _cli(tmp_path, qf, tiny_checkpoint, "--id-column", "nope", inputs=paths) == 2
    assert "column 'nope' is not in" in capsys.readouterr().err
    assert _cli(tmp_path, qf, tiny_checkpoint, "--passthrough", "path", inputs=paths) == 2
    assert "reserved" in capsys.readouterr().err
    assert _cli(tmp_path, qf, tiny_checkpoint, "--passthrough", "intent_confidence", inputs=paths) == 2
    assert "collide" in capsys.readouterr().err
    # an output directory that holds another job's outputs is refused, not mixed
    out = OutputDir(str(tmp_path / "out"))
    os.makedirs(out.root)
    with open(out.path("_job.json"), "w") as fh:
        json.dump({"version": 1, "questions": {"other": {}}}, fh)
    assert _cli(tmp_path, qf, tiny_checkpoint, inputs=paths) == 2
    assert "different job" in capsys.readouterr().err
