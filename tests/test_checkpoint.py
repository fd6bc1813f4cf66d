"""Checkpoint bundles: make-checkpoint, strict loading, tokenizer, and the shapes we promise."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import stat

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import model
from model.bundle import open_bundle
from model.make_checkpoint import SHAPES, make_checkpoint
from model.sequence import SequenceBuilder

from .cases import cases


def test_bundle_layout_and_upstream_names(tiny_checkpoint):
    for rel in ("rl_agent_config.json", "model.safetensors", "tokenizer/tokenizer.json",
                "tokenizer/tokenizer_config.json", "encoder/config.json"):
        assert os.path.isfile(os.path.join(tiny_checkpoint, rel)), rel
    sd = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    assert all(v.dtype == torch.float16 for v in sd.values())
    d = 128
    assert sd["head.layers.0.self_attn.in_proj_weight"].shape == (3 * d, d)
    assert sd["head.layers.1.linear1.weight"].shape == (4 * d, d)
    assert sd["scorer.3.weight"].shape == (1, d)
    assert sd["act_head.0.weight"].shape == (256, d + 4)
    assert sd["type_emb.weight"].shape == (3, d)
    assert "temperature" in sd
    assert "encoder.layers.0.attn_norm.weight" not in sd  # layer 0 uses Identity, as upstream
    assert "encoder.layers.1.attn_norm.weight" in sd
    tok = json.load(open(os.path.join(tiny_checkpoint, "tokenizer/tokenizer.json")))
    assert tok["model"]["type"] == "BPE"
    vocab = tok["model"]["vocab"]
    assert all(t in vocab or any(a["content"] == t for a in tok["added_tokens"])
               for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"))


def test_same_seed_same_bytes_other_seed_differs(tmp_path, tiny_checkpoint):
    a = make_checkpoint(str(tmp_path / "a"), "tiny", seed=0)
    b = make_checkpoint(str(tmp_path / "b"), "tiny", seed=1)
    for rel in ("model.safetensors", "tokenizer/tokenizer.json", "encoder/config.json", "rl_agent_config.json"):
        assert filecmp.cmp(os.path.join(a, rel), os.path.join(tiny_checkpoint, rel), shallow=False), rel
    assert not filecmp.cmp(os.path.join(a, "model.safetensors"), os.path.join(b, "model.safetensors"), shallow=False)
    assert oct(os.stat(os.path.join(a, "model.safetensors")).st_mode & 0o777) == "0o644"


def test_make_checkpoint_does_not_move_the_global_rng(tmp_path):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    make_checkpoint(str(tmp_path / "c"), "tiny", seed=3)
    assert torch.equal(before, torch.random.get_rng_state())


def test_loading_consumes_no_rng(tiny_checkpoint):
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    model.load(tiny_checkpoint, device="cpu", backend="eager")
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize("shape", ["mmbert-base", "modernbert-large"])
def test_big_shapes_are_the_published_architectures(shape):
    s = SHAPES[shape]
    assert (s["hidden"], s["layers"], s["heads"], s["ff"]) == {
        "mmbert-base": (768, 22, 12, 1152), "modernbert-large": (1024, 28, 16, 2624)}[shape]


def test_encoder_config_round_trips(tiny_checkpoint):
    b = open_bundle(tiny_checkpoint)
    e = b.encoder_config
    assert e.model_type == "modernbert" and e.local_attention == 128
    assert [t == "full_attention" for t in e.layer_types] == [i % 3 == 0 for i in range(e.num_hidden_layers)]
    assert e.rope_parameters["full_attention"]["rope_theta"] == 160000.0
    assert e.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0


def test_answers_are_not_uniform(engine):
    """Random weights, but option probabilities spread enough for argmax and |dp| to mean something."""
    tops, spreads = [], []
    for states, qs in cases(30, seed=11):
        for r in engine.predict_batch(states, qs):
            for a in r["answers"].values():
                if a["type"] == "noul":
                    probs = [1 - a["noul"], a["noul"]]
                else:
                    probs = list(a["probabilities"].values())
                if len(probs) < 2:
                    continue
                tops.append(max(probs) - 1 / len(probs))
                spreads.append(max(probs) - min(probs))
    assert np.median(spreads) > 0.15, np.median(spreads)
    assert np.mean(np.array(tops) > 0.05) > 0.8


def test_sequence_builder_ids_equal_the_hf_tokenizer(engine):
    tok = engine.bundle.tokenizer
    b: SequenceBuilder = engine.builder
    for text in ["Hello wörld [MASK] 123", " option: a", "こんにちは 🙂 café" * 30]:
        assert b._ids(text) == tok(text, add_special_tokens=False)["input_ids"]
        assert b._ids(text)[:48] == tok(text, add_special_tokens=False, truncation=True, max_length=48)["input_ids"]


def test_temperatures_are_clamped_like_upstream(tiny_checkpoint, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, d)
    cfg = json.load(open(d / "rl_agent_config.json"))
    cfg["temperature"] = [0.01, 99, True]
    cfg["temperature_by_options"] = {"choice:11+": 0.1006, "noul:2": "warm"}
    json.dump(cfg, open(d / "rl_agent_config.json", "w"))
    with pytest.warns(RuntimeWarning, match="temperature"):
        e = model.load(str(d), device="cpu", backend="eager")
    assert e.temperatures.by_type == [0.5, 5.0, 1.0]
    assert e.temperatures.by_options == {"choice:11+": 0.5, "noul:2": 1.0}


def test_read_only_checkpoint_loads_unchanged(tiny_checkpoint, tmp_path):
    d = tmp_path / "ro"
    shutil.copytree(tiny_checkpoint, d)
    before = {p: open(p, "rb").read() for p in map(str, d.rglob("*")) if os.path.isfile(p)}
    for p in d.rglob("*"):
        p.chmod(stat.S_IRUSR | stat.S_IXUSR if p.is_dir() else stat.S_IRUSR)
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        e = model.load(str(d), device="cpu", backend="eager")
        assert e.predict("hello", {"q": {"type": "noul", "instructions": "hi?"}})["answers"]["q"]["type"] == "noul"
        after = {p: open(p, "rb").read() for p in before}
        assert after == before
    finally:
        for p in [d, *d.rglob("*")]:
            p.chmod(0o755)


def test_upstream_tokenizer_config_variants_load(tiny_checkpoint, tmp_path):
    """Published bundles carry 'TokenizersBackend' and list-valued extra_special_tokens; both load."""
    d = tmp_path / "variant"
    shutil.copytree(tiny_checkpoint, d)
    f = d / "tokenizer" / "tokenizer_config.json"
    cfg = json.load(open(f))
    cfg.update(tokenizer_class="TokenizersBackend", extra_special_tokens=["[X1]"], backend="tokenizers")
    json.dump(cfg, open(f, "w"))
    os.remove(d / "tokenizer" / "special_tokens_map.json")
    e = model.load(str(d), device="cpu", backend="eager")
    assert e.builder.mask_id == e.bundle.tokenizer.convert_tokens_to_ids("[MASK]")
    assert json.load(open(f)) == cfg  # untouched


@pytest.mark.parametrize("damage,match", [
    ("no-config", "rl_agent_config.json"),
    ("no-weights", "model.safetensors"),
    ("missing-key", "missing 1 parameter"),
    ("bad-shape", "architecture mismatch"),
    ("no-scorer", "'scorer.'"),
    ("cfg-keys", "missing configuration keys"),
    ("no-encoder-dir", "encoder/config.json"),
])
def test_broken_bundles_fail_with_the_reason(tiny_checkpoint, tmp_path, damage, match):
    d = tmp_path / damage
    shutil.copytree(tiny_checkpoint, d)
    w = d / "model.safetensors"
    if damage == "no-config":
        os.remove(d / "rl_agent_config.json")
    elif damage == "no-weights":
        os.remove(w)
    elif damage == "no-encoder-dir":
        shutil.rmtree(d / "encoder")
    elif damage == "cfg-keys":
        json.dump({"max_len": 512}, open(d / "rl_agent_config.json", "w"))
    else:
        sd = load_file(str(w))
        if damage == "missing-key":
            del sd["head.layers.1.linear2.bias"]
        elif damage == "bad-shape":
            sd["scorer.1.weight"] = torch.zeros(3, 3, dtype=torch.float16)
        else:
            sd = {k: v for k, v in sd.items() if not k.startswith("scorer.")}
        save_file(sd, str(w))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        model.load(str(d), device="cpu", backend="eager")


def test_unknown_backend_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="unknown backend"):
        model.load(tiny_checkpoint, device="cpu", backend="warp-drive")
