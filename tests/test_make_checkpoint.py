"""make-checkpoint's multilingual shape: the layout upstream's multilingual checkpoint has, a tokenizer that reads
every script, loading with upstream laya and with `model.load`, and both giving the same answers."""

from __future__ import annotations

import filecmp
import json
import os
import re
import warnings

import pytest

import model
from model.bundle import load_tokenizer, open_bundle
from model.make_checkpoint import SHAPES, make_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One request per script the tokenizer must read, plus Latin text with accents
SCRIPT_TEXTS = {
    "cyrillic": "Где мой заказ? Оплата прошла два дня назад",
    "greek": "Η παραγγελία μου δεν έφτασε ακόμα",
    "arabic": "لم يصل طلبي بعد، أريد استرداد المبلغ",
    "hebrew": "ההזמנה שלי עדיין לא הגיעה",
    "devanagari": "मेरा ऑर्डर अभी तक नहीं आया",
    "bengali": "আমার অর্ডার এখনও আসেনি",
    "tamil": "என் ஆர்டர் இன்னும் வரவில்லை",
    "thai": "คำสั่งซื้อของฉันยังไม่มาถึง",
    "georgian": "ჩემი შეკვეთა ჯერ არ მოსულა",
    "armenian": "Իմ պատվերը դեռ չի եկել",
    "ethiopic": "ትዕዛዜ እስካሁን አልደረሰም",
    "han": "我的订单还没有到",
    "kana": "注文がまだ届いていません",
    "hangul": "주문이 아직 도착하지 않았어요",
    "latin": "Ma commande n'est pas arrivée, größer, señor, łódź",
}

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is this urgent?",
               "criteria": {"true": "needs action today", "false": "can wait"}},
    "topic": {"type": "choice", "instructions": "What is it about?",
              "criteria": {"billing": "money", "shipping": "delivery", "account": "login", "other": "else"}},
    "severity": {"type": "score", "instructions": "How severe?", "criteria": ["minor", "moderate", "major"]},
}


def _upstream_laya():
    """The upstream package; a skip on a developer's machine without it, a failure in CI."""
    try:
        import laya
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("upstream laya==0.4.15 is needed (pip install -e '.[dev]')", pytrace=False)
        pytest.skip("upstream laya is not installed")
    return laya


@pytest.fixture(scope="module")
def ml_checkpoint(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("ml") / "tiny-multilingual")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_checkpoint(out, "tiny-multilingual", seed=0)


def test_config_is_shaped_like_the_published_multilingual_checkpoint(ml_checkpoint):
    with open(os.path.join(ml_checkpoint, "rl_agent_config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    assert cfg["encoder"] == "jhu-clsp/mmBERT-base"
    assert (cfg["max_len"], cfg["head_max_len"], cfg["head_layers"]) == (1024, 256, 2)
    assert cfg["temperature"] == [1.0, 1.0, 1.0] and cfg["temperature_by_options"] == {}
    assert cfg["act_costs"] == {"escalate": 0.5} and cfg["training"]["shape"] == "tiny-multilingual"
    enc = open_bundle(ml_checkpoint).encoder_dict
    assert enc["model_type"] == "modernbert" and enc["num_hidden_layers"] == SHAPES["tiny-multilingual"]["layers"]
    assert {k: v["rope_theta"] for k, v in enc["rope_parameters"].items()} == {
        "full_attention": 160000.0, "sliding_attention": 160000.0}


def test_same_seed_same_bytes(ml_checkpoint, tmp_path):
    again = make_checkpoint(str(tmp_path / "again"), "tiny-multilingual", seed=0)
    for rel in ("model.safetensors", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                "encoder/config.json", "rl_agent_config.json"):
        assert filecmp.cmp(os.path.join(again, rel), os.path.join(ml_checkpoint, rel), shallow=False), rel


def test_special_tokens_are_the_mmbert_family_ones(ml_checkpoint):
    tok = load_tokenizer(ml_checkpoint)
    assert (tok.pad_token, tok.cls_token, tok.sep_token, tok.unk_token, tok.mask_token) == (
        "<pad>", "<bos>", "<eos>", "<unk>", "<mask>")
    assert (tok.pad_token_id, tok.sep_token_id, tok.cls_token_id, tok.unk_token_id, tok.mask_token_id) == (
        0, 1, 2, 3, 4)
    with open(os.path.join(ml_checkpoint, "encoder", "config.json"), encoding="utf-8") as fh:
        enc = json.load(fh)
    assert (enc["pad_token_id"], enc["cls_token_id"], enc["sep_token_id"]) == (0, 2, 1)
    assert enc["vocab_size"] >= len(tok) and enc["vocab_size"] % 64 == 0


@pytest.mark.parametrize("script", sorted(SCRIPT_TEXTS))
def test_every_script_tokenizes_to_real_ids(ml_checkpoint, script):
    tok = load_tokenizer(ml_checkpoint)
    text = SCRIPT_TEXTS[script]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids and tok.unk_token_id not in ids
    pieces = tok.convert_ids_to_tokens(ids)
    # the script's letters are tokens of their own (byte pieces only for what the alphabet lacks)
    assert sum(not re.fullmatch(r"<0x[0-9A-F]{2}>", p) for p in pieces) >= len(pieces) // 2, pieces
    assert tok.decode(ids) == text


def test_unseen_characters_fall_back_to_bytes_not_unk(ml_checkpoint):
    tok = load_tokenizer(ml_checkpoint)
    ids = tok("\U0001F600 \u9f98 \U00010348", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert all(re.fullmatch(r"<0x[0-9A-F]{2}>|\u2581", p) for p in tok.convert_ids_to_tokens(ids))


def test_the_english_tokenizer_turns_scripts_into_bytes_the_multilingual_one_does_not(ml_checkpoint, bundle):
    text = SCRIPT_TEXTS["thai"]
    en = bundle.tokenizer(text, add_special_tokens=False)["input_ids"]
    ml = load_tokenizer(ml_checkpoint)(text, add_special_tokens=False)["input_ids"]
    assert len(ml) < len(en)


def _states():
    yield from SCRIPT_TEXTS.values()
    yield {"subject": SCRIPT_TEXTS["kana"], "body": SCRIPT_TEXTS["cyrillic"], "id": 7}
    yield [{"role": "user", "content": SCRIPT_TEXTS["arabic"]}, {"role": "assistant", "content": "ok"},
           {"role": "user", "content": SCRIPT_TEXTS["hangul"]}]
    yield "Where is my order? " * 120  # past max_len (1024): truncation agrees too


def test_upstream_and_ours_load_it_and_agree(ml_checkpoint):
    laya = _upstream_laya()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = laya.load(ml_checkpoint, device="cpu")
        ours = model.load(ml_checkpoint, device="cpu", backend="eager")
    for state in _states():
        a, b = theirs.predict(state, QUESTIONS), ours.predict(state, QUESTIONS)
        assert a["usage"] == b["usage"], state
        for qid in QUESTIONS:
            pa, pb = a["answers"][qid], b["answers"][qid]
            assert (pa["type"], pa.get("choice")) == (pb["type"], pb.get("choice")), (state, qid)
            for k in ("score", "noul", "confidence", "answer_confidence"):
                if k in pa:
                    assert abs(pa[k] - pb[k]) <= 1e-4, (state, qid, k)
            assert (pa.get("probabilities") or {}).keys() == (pb.get("probabilities") or {}).keys()
            for label, p in (pa.get("probabilities") or {}).items():
                assert abs(p - pb["probabilities"][label]) <= 1e-4, (state, qid, label)


def test_upstream_router_serves_both_tiny_checkpoints(ml_checkpoint, tiny_checkpoint):
    laya = _upstream_laya()
    router = laya.Router(models={"english": tiny_checkpoint, "multilingual": ml_checkpoint}, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ml = router.predict(SCRIPT_TEXTS["devanagari"], QUESTIONS)
        en = router.predict("Where is my order? It was due last week and the tracking has not moved.", QUESTIONS)
    assert (ml["routing"]["model"], en["routing"]["model"]) == ("multilingual", "english")
    assert set(ml["answers"]) == set(en["answers"]) == set(QUESTIONS)


def test_make_checkpoint_target_makes_both_and_serve_and_test_need_it():
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as fh:
        text = fh.read()
    assert "--shape tiny --out $(CHECKPOINT)" in text
    assert "--shape tiny-multilingual --out $(ML_CHECKPOINT)" in text
    assert re.search(r"^ML_CHECKPOINT := checkpoints/tiny-multilingual$", text, re.M)
    target = re.search(r"^checkpoint: (.*)$", text, re.M).group(1).split()
    assert target == ["$(CHECKPOINT)/model.safetensors", "$(ML_CHECKPOINT)/model.safetensors"]
    for name in ("serve", "test"):
        assert "checkpoint" in re.search(r"^%s: (.*)$" % name, text, re.M).group(1).split(), name
