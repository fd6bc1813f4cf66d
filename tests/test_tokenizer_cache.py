"""model/tokenizer.py: a checkpoint's tokenizer read from the node-local cache's record, without transformers, is
the one transformers builds: the same Rust tokenizer JSON, special tokens and ids, the same rows."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings

import pytest

from model import tokenizer as T
from model.bundle import load_tokenizer
from model.sequence import SequenceBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["my order arrived late and the box was broken", "[MASK] is [CLS] here [SEP] and [PAD]",
         "Mañana: ¿dónde está? 東京で会いましょう — Привет, мир! 123,456.78", "  leading and  double  spaces ",
         "", "x" * 3000, "a [MASK]b [UNK] c"]


@pytest.fixture(scope="module")
def ml_checkpoint(tmp_path_factory) -> str:
    from model.make_checkpoint import make_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_checkpoint(str(tmp_path_factory.mktemp("ml") / "tiny-multilingual"), "tiny-multilingual", seed=0)


@pytest.fixture(params=["tiny", "tiny-multilingual"])
def checkpoint(request, tiny_checkpoint, ml_checkpoint):
    return {"tiny": tiny_checkpoint, "tiny-multilingual": ml_checkpoint}[request.param]


def _cache_env(tmp_path) -> dict[str, str]:
    return dict(os.environ, LAYA_FLEET_LOCAL_CACHE_DIR=str(tmp_path / "local"), PYTHONPATH=ROOT)


def test_a_recorded_tokenizer_is_the_one_transformers_builds(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYA_FLEET_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    first = load_tokenizer(checkpoint)            # builds with transformers, records
    records = os.listdir(tmp_path / "local" / T.CACHE_KIND)
    assert len(records) == 1 and records[0].endswith(".json")
    second = load_tokenizer(checkpoint)           # from the record
    assert second._hf is None and first._hf is not None
    hf = first.hf
    assert second.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    for k in T.IDS + T.TOKENS:
        assert getattr(second, k) == getattr(hf, k), k
    a, b = SequenceBuilder(hf), SequenceBuilder(second)
    assert [a._ids(t) for t in TEXTS] == [b._ids(t) for t in TEXTS]
    assert a._batch(TEXTS) == b._batch(TEXTS)
    # the rest is transformers' own wrapper, built on first use
    assert len(second) == len(hf) and second("a b", add_special_tokens=False) == hf("a b", add_special_tokens=False)
    assert second.convert_tokens_to_ids("[MASK]") == hf.convert_tokens_to_ids("[MASK]")
    back = pickle.loads(pickle.dumps(second))
    assert back.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str() and back.pad_token_id == hf.pad_token_id


def test_a_bad_record_is_rebuilt_and_other_special_tokens_key_another(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYA_FLEET_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    good = load_tokenizer(tiny_checkpoint)
    (rec,) = (tmp_path / "local" / T.CACHE_KIND).iterdir()
    rec.write_text('{"v": 1, "backend": 3}')
    again = load_tokenizer(tiny_checkpoint)
    assert again._hf is not None   # rebuilt by transformers, and recorded over the bad file
    assert json.loads(rec.read_text())["backend"] == good.backend_tokenizer.to_str()
    tok_file = os.path.join(tiny_checkpoint, "tokenizer", "tokenizer.json")
    assert T.record_key(tok_file, {"pad_token": "[PAD]"}) != T.record_key(tok_file, {"pad_token": "[CLS]"})
    assert load_tokenizer(tiny_checkpoint, cache=False)._hf is not None


def test_a_process_with_the_record_never_imports_transformers(tiny_checkpoint, tmp_path):
    """The first process records the tokenizer (importing transformers); the next one opens the checkpoint's
    codec and encodes a state with the `tokenizers` library alone."""
    code = ("import sys, model\n"
            "from model.codec import Codec\n"
            "c = Codec.open(%r)\n"
            "rows = c.encode('my order arrived broken', c.prepare({'angry': {'type': 'noul', "
            "'instructions': 'Is the customer angry?'}})).rows\n"
            "print(len(rows[0].ids), 'transformers' in sys.modules)\n" % tiny_checkpoint)
    env = _cache_env(tmp_path)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    (n1, imported1), (n2, imported2) = (r.stdout.split()[-2:] for r in runs)
    assert n1 == n2 and imported1 == "True" and imported2 == "False"
