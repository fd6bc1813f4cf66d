"""The plain-torch ModernBERT (model/backends/torch_encoder.py) against transformers' ModernBertModel, and the
DecisionModel built on it against the one `load_model` builds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.backends.torch_encoder import NativeModernBert, load_native_model
from model.bundle import light_encoder_config, load_model, open_bundle


def _batch(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), L), generator=g)
    att = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        att[i, :n] = 1
        ids[i, n:] = 0
    return ids, att


@pytest.mark.parametrize("layers,every,norm_bias,attention_bias,thetas,local", [
    (4, 3, False, False, (160000.0, 10000.0), 128),
    (5, 2, True, True, (80000.0, 20000.0), 64),
    (3, 1, False, True, (10000.0, 10000.0), 32),
])
def test_native_encoder_equals_transformers_modernbert(layers, every, norm_bias, attention_bias, thetas, local):
    from transformers import ModernBertConfig, ModernBertModel

    cfg = ModernBertConfig(vocab_size=320, hidden_size=128, intermediate_size=96, num_hidden_layers=layers,
                           num_attention_heads=2, global_attn_every_n_layers=every, norm_bias=norm_bias,
                           attention_bias=attention_bias, global_rope_theta=thetas[0], local_rope_theta=thetas[1],
                           local_attention=local, max_position_embeddings=512, pad_token_id=0,
                           attn_implementation="sdpa")
    torch.manual_seed(1)
    ref = ModernBertModel(cfg).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a swapped or dropped one shows
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    light = light_encoder_config(cfg.to_dict())
    assert light is not None
    ours = NativeModernBert(light).eval()
    ours.load_state_dict(ref.state_dict(), strict=False)
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in ref.named_parameters()}
    # lengths past the window, a row of one token, heavy padding
    lengths = [300, 1, 37, 129, 2 * local + 5]
    ids, att = _batch(lengths, 320)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=att).last_hidden_state
        got = ours(ids, att).last_hidden_state
        assert torch.isfinite(got).all()  # padding positions too: the head attends over them masked
        real = att.bool()
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want16 = ref(input_ids=ids, attention_mask=att).last_hidden_state.float()
            got16 = ours(ids, att).last_hidden_state.float()
        # same rounding points as transformers: bf16 agreement far tighter than bf16 vs fp32
        d16 = (got16[real] - want16[real]).abs().max()
        d32 = (want16[real] - want[real]).abs().max()
        assert d16 <= 0.25 * d32, (float(d16), float(d32))


def test_native_decision_model_equals_load_model(tiny_checkpoint):
    b = open_bundle(tiny_checkpoint)
    ref, ours = load_model(b), load_native_model(b)
    assert ours is not None and isinstance(ours.encoder, NativeModernBert)
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == \
        {n: tuple(p.shape) for n, p in ref.named_parameters()}
    ids, att = _batch([60, 9, 200], len(b.tokenizer), seed=3)
    ids[:, 0] = b.tokenizer.cls_token_id
    mpos = torch.tensor([[1, 5, 9], [1, 3, 0], [2, 50, 150]])
    mmask = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
    qtype = torch.tensor([0, 1, 2])
    with torch.no_grad():
        a = ref(ids, att, mpos, mmask, qtype)
        o = ours(ids, att, mpos, mmask, qtype)
    np.testing.assert_allclose(o[0].numpy(), a[0].numpy(), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(o[1].numpy(), a[1].numpy(), atol=2e-4, rtol=1e-4)


def test_native_model_stands_aside_for_configs_it_cannot_describe(tiny_checkpoint, tmp_path):
    import json
    import shutil

    ck = tmp_path / "old"
    shutil.copytree(tiny_checkpoint, ck)
    f = ck / "encoder" / "config.json"
    cfg = json.loads(f.read_text())
    del cfg["rope_parameters"]
    f.write_text(json.dumps(cfg))
    assert load_native_model(open_bundle(str(ck))) is None
