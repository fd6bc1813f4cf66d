"""The fast backend's weights-only model (model/backends/fast/weights.py) against transformers' ModernBERT and the
full model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import model
from model.backends.fast import make_backend
from model.backends.fast.weights import expected_encoder_shapes, load_fast_model
from model.backends.torch_encoder import rope_tables
from model.bundle import load_model, open_bundle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("layers,every,norm_bias,attention_bias,mlp_bias,thetas", [
    (3, 3, False, False, False, (160000.0, 10000.0)),
    (5, 2, True, True, True, (80000.0, 20000.0)),
    (2, 1, False, True, False, (10000.0, 10000.0)),
])
def test_layout_and_rope_match_transformers_modernbert(layers, every, norm_bias, attention_bias, mlp_bias, thetas):
    from transformers import ModernBertConfig, ModernBertModel

    cfg = ModernBertConfig(vocab_size=320, hidden_size=128, intermediate_size=96, num_hidden_layers=layers,
                           num_attention_heads=2, global_attn_every_n_layers=every, norm_bias=norm_bias,
                           attention_bias=attention_bias, mlp_bias=mlp_bias, global_rope_theta=thetas[0],
                           local_rope_theta=thetas[1], max_position_embeddings=256, pad_token_id=0)
    m = ModernBertModel(cfg)
    params = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert expected_encoder_shapes(cfg) == params
    ours = rope_tables(cfg)
    assert ours is not None and set(ours) == set(cfg.layer_types)
    for lt, (inv, scale) in ours.items():
        torch.testing.assert_close(inv, getattr(m.rotary_emb, "%s_inv_freq" % lt), rtol=0, atol=0)
        assert scale == getattr(m.rotary_emb, "%s_attention_scaling" % lt)


def test_fast_forward_from_the_light_model_equals_the_full_model(bundle, rows):
    light = load_fast_model(bundle)
    assert light is not None and getattr(light, "weights_only", False)
    assert not isinstance(light.encoder, torch.nn.Module)
    # the encoder keeps the checkpoint's dtype (fp16 here): the fast backend converts on its device
    assert {light.encoder.layers[0].attn.Wqkv.weight.dtype, light.encoder.embeddings.norm.weight.dtype} == {
        torch.float16}
    full = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=4096)
    fast = make_backend(light, bundle, torch.device("cpu"), ops="torch", max_batch_tokens=4096)
    a, b = full.forward(rows), fast.forward(rows)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_model_load_fast_never_imports_transformers_modeling(tiny_checkpoint, rows_scored):
    code = (
        "import sys, json, numpy as np, model\n"
        "from tests import cases as C\n"
        "e = model.load(%r, device='cpu', backend='fast', ops='torch')\n"
        "mods = [m for m in ('transformers.modeling_utils', 'transformers.models.modernbert.modeling_modernbert',"
        " 'transformers.generation.utils', 'sklearn', 'transformers.models.auto', 'transformers.generation',"
        " 'torch._dynamo', 'torch.distributed.tensor') if m in sys.modules]\n"
        "rows = []\n"
        "for states, qs in C.cases(10):\n"
        "    p = e.prepare(qs)\n"
        "    for enc in e.encode_many(states, p):\n"
        "        rows += enc.rows\n"
        "lg, act = e.score(rows)\n"
        "print(json.dumps({'backend': e.backend_name, 'mods': mods, 'lg': np.asarray(lg).tolist(),"
        " 'act': np.asarray(act).tolist()}))\n" % tiny_checkpoint)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["backend"] == "fast" and out["mods"] == []
    lg, act = rows_scored
    np.testing.assert_allclose(np.array(out["lg"]), lg, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(out["act"]), act, atol=1e-5)


@pytest.mark.parametrize("shape", ["tiny", "mmbert-base", "modernbert-large"])
def test_light_encoder_config_reads_what_transformers_reads(shape, tmp_path):
    """The plain config (no transformers import) gives the fast backend the same values as ModernBertConfig
    for each make-checkpoint shape, and stands aside (None) where it cannot be sure."""
    from transformers import AutoConfig, ModernBertConfig

    from model.bundle import LIGHT_KEYS, LIGHT_OPTIONAL, light_encoder_config
    from model.make_checkpoint import SHAPES

    s = SHAPES[shape]
    types = ["full_attention" if i % 3 == 0 else "sliding_attention" for i in range(s["layers"])]
    ModernBertConfig(vocab_size=s["vocab"] or 1984, hidden_size=s["hidden"], intermediate_size=s["ff"],
                     num_hidden_layers=s["layers"], num_attention_heads=s["heads"], layer_types=types,
                     rope_parameters={"full_attention": {"rope_theta": 160000.0, "rope_type": "default"},
                                      "sliding_attention": {"rope_theta": s["local_theta"], "rope_type": "default"}},
                     ).save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        data = json.load(f)
    hf = AutoConfig.from_pretrained(str(tmp_path))
    light = light_encoder_config(data)
    assert light is not None
    for k in LIGHT_KEYS + tuple(LIGHT_OPTIONAL) + ("sliding_window", "model_type"):
        assert getattr(light, k) == getattr(hf, k), k
    assert getattr(light, "head_dim", None) is None and "head_dim" not in data
    assert {lt: (inv.tolist(), sc) for lt, (inv, sc) in rope_tables(light).items()} == \
        {lt: (inv.tolist(), sc) for lt, (inv, sc) in rope_tables(hf).items()}
    # what it leaves to transformers: older configs, scaled RoPE, another family
    for drop in ("layer_types", "rope_parameters", "norm_eps"):
        assert light_encoder_config({k: v for k, v in data.items() if k != drop}) is None, drop
    scaled = json.loads(json.dumps(data))
    scaled["rope_parameters"]["full_attention"].update(rope_type="linear", factor=2.0)
    assert light_encoder_config(scaled) is None
    assert light_encoder_config(dict(data, model_type="bert")) is None
    # values it cannot vouch for are left to transformers' config and its errors
    for bad in ({"num_hidden_layers": "many"}, {"hidden_size": data["hidden_size"] + 1}, {"vocab_size": 0}):
        assert light_encoder_config(dict(data, **bad)) is None, bad


def test_incomplete_or_mismatched_checkpoints_are_refused_as_before(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    w = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    for case in ("missing", "shape"):
        d = tmp_path / case
        shutil.copytree(tiny_checkpoint, d)
        bad = dict(w)
        if case == "missing":
            del bad["encoder.layers.1.attn.Wo.weight"]
        else:
            bad["encoder.final_norm.weight"] = torch.ones(7)
        save_file(bad, str(d / "model.safetensors"))
        b = open_bundle(str(d))
        if case == "missing":
            assert load_fast_model(b) is None  # not the ModernBERT layout: the full load decides, and refuses
            with pytest.raises(ValueError, match="incomplete"):
                model.load(str(d), device="cpu", backend="fast", ops="torch")
        else:
            with pytest.raises(ValueError, match="final_norm.weight"):
                load_fast_model(b)
