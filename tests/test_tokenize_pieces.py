"""Long states tokenized in pieces (cut at single spaces, one parallel batch) give exactly the whole text's ids."""

from __future__ import annotations

import json
import random

import pytest

from model.sequence import PIECE_CHARS, SequenceBuilder, piece_safe, split_points, split_text

WORDS = ["refund", "order", "it's", "don't", "caf\u00e9", "na\u00efve", "\u00fcber", "12", "3.5", "2024-11-30",
         "x1", "y2", "\u4e2d\u6587", "(see", "this)", "e-mail:", "user@example.com", "$40.00", "100%", "...",
         "Stra\u00dfe", "\u0394\u03b5\u03bb\u03c4\u03b1", "emoji\U0001F600", "tab\there", "line\nbreak", "ok!",
         "\"quoted\"", "'single'", "A", "I", "e\u0301t\u00e9", "\u00bd", "CAPS", "MiXeD", "[MASK]", "[SEP]"]
SEPS = [" "] * 12 + ["  ", "\n", " \n ", "\t", ", ", "; "]


def texts(seed: int, n: int, words: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(words // 2, words)):
            parts.append(rng.choice(WORDS))
            parts.append(rng.choice(SEPS))
        out.append("".join(parts).strip() + rng.choice(["", " ", "  ", "."]))
    return out


def wordpiece_builder(bundle) -> SequenceBuilder:
    """A SequenceBuilder over a BERT-style tokenizer (BertNormalizer + BertPreTokenizer + WordPiece) trained here."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts(1, 200, 60), trainer=trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"], show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                 pad_token="[PAD]", mask_token="[MASK]")
    return SequenceBuilder(hf, bundle.max_len, bundle.head_max_len)


@pytest.mark.parametrize("every", [1, 5, 37, PIECE_CHARS])
def test_split_points_cut_only_single_spaces_between_letters_or_digits(every):
    for t in texts(2, 30, 400):
        cuts = split_points(t, every)
        assert "".join(split_text(t, every)) == t
        assert cuts == sorted(set(cuts))
        for p in cuts:
            assert t[p] == " " and t[p - 1].isalnum() and t[p + 1].isalnum(), (t[p - 2:p + 3], p)
        if every > 1 and len(t) > 4 * every:
            assert cuts, "a long text of many words has cut points"
        for a, b in zip(cuts, cuts[1:]):
            assert b - a >= every


@pytest.mark.parametrize("kind", ["byte_level_bpe", "wordpiece"])
def test_pieces_give_the_whole_texts_ids(bundle, kind):
    b = SequenceBuilder(bundle.tokenizer, bundle.max_len, bundle.head_max_len) if kind == "byte_level_bpe" \
        else wordpiece_builder(bundle)
    assert b.piece_chars == PIECE_CHARS or b.cores < 2
    b.piece_chars = PIECE_CHARS
    sample = texts(3, 40, 900)
    whole = [b._ids(t) for t in sample]
    for every in (1, 7, 64, PIECE_CHARS):
        got = [[i for p in split_text(t, every) for i in b._ids(p)] for t in sample]
        assert got == whole, "pieces of %d characters" % every
    # through the builder's own batch path, as many cores would cut it (4 pieces a core)
    b.cores = 16
    assert b.piece_length(sample[:3]) >= PIECE_CHARS
    clean = [b._ids(b._clean(t)) for t in sample[:3]]   # states lose their [MASK] tokens
    assert b.states_ids(sample[:3]) == clean
    assert b.state_ids(sample[0]) == clean[0]
    state = {"customer": sample[1], "history": sample[2].split("\n")}
    b.cores = 1
    ref = b.state_ids(state)
    b.cores = 16
    assert b.state_ids(state) == ref


def test_when_pieces_are_cut(bundle):
    b = SequenceBuilder(bundle.tokenizer, bundle.max_len, bundle.head_max_len)
    b.piece_chars, b.cores = PIECE_CHARS, 8
    long, short = "word " * 2000, "word " * 50
    assert b.piece_length([short]) == 0                     # nothing long enough
    assert b.piece_length([long]) == PIECE_CHARS            # 10000 chars / 32 pieces -> 312, raised to the floor
    assert b.piece_length([long * 5]) == 50000 // 32        # about 4 pieces a core
    assert b.piece_length([long] * 16) == 0                # 2 texts a core: the batch is parallel already
    assert b.piece_length([long] * 30 + [short]) == 0


def test_tokenizers_that_could_change_at_a_cut_are_never_cut(bundle):
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    spec = json.loads(bundle.tokenizer.backend_tokenizer.to_str())
    assert piece_safe(json.dumps(spec)) == (True, "")

    def variant(**kw):
        t = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        t.pre_tokenizer = kw.get("pre", pre_tokenizers.Whitespace())
        if "norm" in kw:
            t.normalizer = kw["norm"]
        if "added" in kw:
            t.add_tokens([kw["added"]])
        return t.to_str()

    assert piece_safe(variant()) == (True, "")
    assert piece_safe(variant(norm=normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])))[0]
    refused = {
        "Metaspace": variant(pre=pre_tokenizers.Metaspace()),
        "ByteLevel without its regex": variant(pre=pre_tokenizers.ByteLevel(use_regex=False)),
        "Split": variant(pre=pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                      pre_tokenizers.Split(" ", "isolated")])),
        "Replace": variant(norm=normalizers.Sequence([normalizers.NFC(), normalizers.Replace("a b", "c")])),
        "Strip": variant(norm=normalizers.Strip()),
        "rstrip": variant(added=AddedToken("zz", rstrip=True)),
        "space inside": variant(added=AddedToken("new york")),
    }
    for name, js in refused.items():
        ok, why = piece_safe(js)
        assert not ok and why, name


def test_answers_with_pieces_match_upstream(engine, oracle):
    from .cases import cases
    from .test_parity import _assert_same

    qs = cases(4)[1][1]
    long = texts(5, 4, 900)
    states = long[:2] + [{"ticket": long[2], "notes": ["a", long[3][:3000]]}, [long[3], "latest turn " * 40]]
    b = engine.builder
    saved = b.cores, b.piece_chars
    try:
        b.cores, b.piece_chars = 16, PIECE_CHARS
        assert b.piece_length([long[0]]) and b.piece_length(long[:2])
        _assert_same(engine.predict_batch(states, qs), oracle.predict_batch(states, qs), "batch")
        for i, s in enumerate(states):
            _assert_same(engine.predict(s, qs), oracle.predict(s, qs), "state%d" % i)
    finally:
        b.cores, b.piece_chars = saved
