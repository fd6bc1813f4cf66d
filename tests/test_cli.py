"""The `laya-fleet` console script, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "model.cli", *args], capture_output=True, text=True, timeout=300, **kw)


def test_predict_prints_the_answer_json(tiny_checkpoint, tmp_path, engine):
    qs = {"intent": {"type": "choice", "instructions": "What?", "criteria": ["refund", "info"]},
          "angry": {"type": "noul", "instructions": "Angry?"}}
    qf = tmp_path / "q.json"
    qf.write_text(json.dumps(qs))
    sf = tmp_path / "state.txt"
    sf.write_text("my parcel is late")
    r = _run("predict", "--checkpoint", tiny_checkpoint, "--state", "@%s" % sf, "--questions", str(qf),
             "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == engine.predict("my parcel is late", qs)
    r = _run("predict", "--checkpoint", tiny_checkpoint, "--state", '{"a": [1, 2]}', "--json-state",
             "--questions", str(qf), "--device", "cpu")
    assert json.loads(r.stdout) == engine.predict({"a": [1, 2]}, qs)


def test_predict_bad_questions_exit_2_with_reason(tiny_checkpoint, tmp_path):
    qf = tmp_path / "q.json"
    qf.write_text(json.dumps({"x": {"type": "score", "instructions": "?", "criteria": []}}))
    r = _run("predict", "--checkpoint", tiny_checkpoint, "--state", "s", "--questions", str(qf), "--device", "cpu")
    assert r.returncode == 2 and "question 'x'" in r.stderr and "Traceback" not in r.stderr
    qf.write_text("{not json")
    r = _run("predict", "--checkpoint", tiny_checkpoint, "--state", "s", "--questions", str(qf), "--device", "cpu")
    assert r.returncode == 2 and "cannot read questions file" in r.stderr


def test_make_checkpoint_command(tmp_path):
    r = _run("make-checkpoint", "--shape", "tiny", "--out", str(tmp_path / "ck"), "--seed", "4")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ck" / "model.safetensors").is_file()
    r = _run("make-checkpoint", "--shape", "gigantic", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_precompile_command_and_module_take_the_same_flags():
    """`laya-fleet precompile` and `python -m model.backends.fast.precompile` are one command (the image build
    runs the first with `--shapes modernbert-large`; bench/gpu_env.sh unpacks what `--pack` writes)."""
    r = _run("precompile", "--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--shapes", "--tests", "--sweep", "--workers", "--fp16", "--arch", "--pack"):
        assert flag in r.stdout, flag
    m = subprocess.run([sys.executable, "-m", "model.backends.fast.precompile", "--help"], capture_output=True,
                       text=True, timeout=300)
    assert m.returncode == 0 and m.stdout == r.stdout


def test_precompile_ln_fold_m_adds_the_folded_kernels_and_refuses_a_small_bucket():
    """`--ln-fold-m M` builds the forward's kernels under a table folding from M tokens up (what bench/fast_path.py's
    fold engines run): the plain list plus the folded Wqkv / GeGLU and the two residual epilogues; a bucket the
    small tiles run is an error naming the flag, not an empty build."""
    from kernels.tuning import TABLE
    from model.backends.fast.precompile import model_specs

    plain = model_specs("modernbert-large")
    folded = model_specs("modernbert-large", fold_m=TABLE.small_m + 128)
    extra = [s for s in folded if s not in plain]
    assert set(plain) <= set(folded)
    assert sorted(args[9] for kind, args in extra) == ["fold", "fold", "residual", "residual"], extra
    r = _run("precompile", "--shapes", "tiny", "--ln-fold-m", str(TABLE.small_m))
    assert r.returncode == 2 and "--ln-fold-m" in r.stderr and "small_m" in r.stderr, r.stderr
