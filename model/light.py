"""The model for the fast backend, built without transformers' modeling code.

The fast backend only reads weights and config from the encoder: it runs its own kernels. Building the
transformers `ModernBertModel` to get them imports `transformers.modeling_utils` and what it pulls in
(`transformers.generation` -> scikit-learn, `transformers.distributed` -> `torch.distributed.tensor`): on the
H200 host most of a warm replica's load time (BENCHMARKS.md, third session). Here the encoder is a tree of
plain attributes over the safetensors tensors with the same names and shapes the transformers module has
(`encoder.embeddings.tok_embeddings.weight`, `encoder.layers.3.attn.Wqkv.weight`, ...), plus the per-layer-type
RoPE inverse frequencies the module would compute; the decision head, scorer and act head are this
project's own torch modules (model/network.py), loaded strictly as always.

`load_fast_model` returns None where the checkpoint is not one it can describe (another encoder family, no
`rope_parameters` in the config, e.g. transformers 4.x): the caller then loads the full model.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from .bundle import Bundle, load_weights

log = logging.getLogger(__name__)

ENC = "encoder."


class WeightTree(SimpleNamespace):
    """Attribute access over a dotted-name tensor dict: `tree.layers[2].attn.Wqkv.weight`. A tensor the
    checkpoint does not have reads as None, as an absent bias does on a torch module."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _tree(weights: dict[str, torch.Tensor], prefix: str) -> WeightTree:
    root: dict = {}
    for name, t in weights.items():
        if not name.startswith(prefix):
            continue
        node = root
        parts = name[len(prefix):].split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = t

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            return [build(node[str(i)]) if str(i) in node else None for i in range(max(map(int, node)) + 1)]
        return WeightTree(**{k: build(v) for k, v in node.items()})

    return build(root)


def _layer_types(ecfg: Any) -> list[str]:
    types = getattr(ecfg, "layer_types", None)
    if types:
        return list(types)
    every = int(getattr(ecfg, "global_attn_every_n_layers", 1) or 1)
    return ["full_attention" if i % every == 0 else "sliding_attention" for i in range(int(ecfg.num_hidden_layers))]


def rope_tables(ecfg: Any) -> dict[str, tuple[torch.Tensor, float]] | None:
    """{layer type: (inverse frequencies, attention scaling)} as transformers' ModernBERT computes them, or
    None when the config carries no per-layer-type `rope_parameters`."""
    params = getattr(ecfg, "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    dim = getattr(ecfg, "head_dim", None) or ecfg.hidden_size // ecfg.num_attention_heads
    out = {}
    for lt in sorted(set(_layer_types(ecfg))):
        p = params.get(lt)
        if not isinstance(p, dict) or "rope_theta" not in p:
            return None
        kind = p.get("rope_type", "default")
        if kind == "default":
            exps = torch.arange(0, dim, 2, dtype=torch.float) / dim
            out[lt] = (1.0 / (float(p["rope_theta"]) ** exps), 1.0)
        else:  # scaled variants: transformers' own (config-level) init functions, no modeling import
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv, scale = ROPE_INIT_FUNCTIONS[kind](ecfg, None, layer_type=lt)
            out[lt] = (inv, float(scale))
    return out


def expected_encoder_shapes(ecfg: Any) -> dict[str, tuple[int, ...]]:
    """The encoder tensors (names after `encoder.`) and shapes a ModernBERT checkpoint of this config has."""
    d, inter, n = int(ecfg.hidden_size), int(ecfg.intermediate_size), int(ecfg.num_hidden_layers)
    norm_b, attn_b, mlp_b = (bool(getattr(ecfg, k, False)) for k in ("norm_bias", "attention_bias", "mlp_bias"))
    out: dict[str, tuple[int, ...]] = {"embeddings.tok_embeddings.weight": (int(ecfg.vocab_size), d)}

    def norm(name: str) -> None:
        out[name + ".weight"] = (d,)
        if norm_b:
            out[name + ".bias"] = (d,)

    def linear(name: str, o: int, i: int, bias: bool) -> None:
        out[name + ".weight"] = (o, i)
        if bias:
            out[name + ".bias"] = (o,)

    norm("embeddings.norm")
    for i in range(n):
        if i > 0:  # layer 0's attention norm is an identity in ModernBERT
            norm("layers.%d.attn_norm" % i)
        linear("layers.%d.attn.Wqkv" % i, 3 * d, d, attn_b)
        linear("layers.%d.attn.Wo" % i, d, d, attn_b)
        norm("layers.%d.mlp_norm" % i)
        linear("layers.%d.mlp.Wi" % i, 2 * inter, d, mlp_b)
        linear("layers.%d.mlp.Wo" % i, d, inter, mlp_b)
    norm("final_norm")
    return out


def load_fast_model(bundle: Bundle) -> torch.nn.Module | None:
    """The DecisionModel for the fast backend with a weights-only encoder (see the module doc), or None when
    this checkpoint needs the full model. Weights are checked as strictly as `load_model` checks them."""
    from .bundle import build_head, verify

    ecfg = bundle.light_encoder_config() or bundle.encoder_config
    if getattr(ecfg, "model_type", None) != "modernbert":
        return None
    rope = rope_tables(ecfg)
    if rope is None:
        return None
    weights = load_weights(bundle.path)
    want = expected_encoder_shapes(ecfg)
    have = {k[len(ENC):]: tuple(v.shape) for k, v in weights.items() if k.startswith(ENC)}
    if set(have) != set(want):
        log.info("fast model: encoder tensors differ from the ModernBERT layout (missing %s, extra %s); "
                 "loading the full model", sorted(set(want) - set(have))[:3], sorted(set(have) - set(want))[:3])
        return None
    bad = ["%s: expected %s, found %s" % (k, want[k], have[k]) for k in want if have[k] != want[k]]
    if bad:
        raise ValueError("Model architecture mismatch for %r: %s" % (bundle.path, "; ".join(bad[:5])))

    model = build_head(bundle, ecfg)
    verify(model, weights, bundle.path)  # the head, scorer and act head, as load_model checks them
    model.load_state_dict({k: v for k, v in weights.items() if not k.startswith(ENC)}, strict=True)
    model = model.float().eval().requires_grad_(False)
    del model.encoder
    enc = _tree({k: v.float() for k, v in weights.items() if k.startswith(ENC)}, ENC)
    enc.config = ecfg
    enc.rotary_emb = WeightTree(**{"%s_inv_freq" % lt: inv for lt, (inv, _) in rope.items()},
                                **{"%s_attention_scaling" % lt: s for lt, (_, s) in rope.items()})
    object.__setattr__(model, "encoder", enc)  # not a submodule: plain tensors the fast path copies out
    model.light = True
    return model


__all__ = ["WeightTree", "load_fast_model", "rope_tables", "expected_encoder_shapes"]
