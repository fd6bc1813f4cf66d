"""A ModernBERT encoder in plain torch, for the `compile` backend: no transformers import, no guards torch
cannot serialise.

transformers' `ModernBertModel` is the reference (the eager backend and the upstream oracle run it); importing
its modeling code costs seconds on a warm start and dynamo re-traces its Python, whose guards are object-identity
checks. This module computes the same function from the same tensors (`encoder.*` names and shapes unchanged, so the
checkpoint loads strictly): embeddings + LayerNorm, pre-norm layers with RoPE attention (full on global
layers, |i - j| <= local_attention / 2 on local layers) and a GeGLU MLP, final LayerNorm. The precision
steps follow transformers' (RoPE applied in fp32 and cast back, SDPA on the projections' dtype), so under
bf16 autocast it rounds where the reference rounds. tests/test_native.py checks it against
`ModernBertModel` for several layouts, biases, RoPE thetas, paddings and lengths past the window.

`layer_types` and `rope_tables` read ModernBERT's config as transformers does (the fast backend's weights use
them too). `load_native_model` returns None where the checkpoint is not one it can describe (see
`Bundle.light_encoder_config`): the caller then uses the transformers model.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..bundle import Bundle, load_weights

log = logging.getLogger(__name__)

ENC = "encoder."


class EncoderOutput(NamedTuple):
    last_hidden_state: torch.Tensor


def layer_types(ecfg: Any) -> list[str]:
    """Each encoder layer's attention kind ("full_attention" / "sliding_attention"), from the config."""
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
    for lt in sorted(set(layer_types(ecfg))):
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


def _norm(d: int, eps: float, bias: bool) -> nn.LayerNorm:
    return nn.LayerNorm(d, eps=eps, bias=bias)


class _Embeddings(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.tok_embeddings = nn.Embedding(int(cfg.vocab_size), int(cfg.hidden_size))
        self.norm = _norm(int(cfg.hidden_size), float(cfg.norm_eps), bool(cfg.norm_bias))


class _Attention(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        d = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.head_dim = d // self.heads
        self.Wqkv = nn.Linear(d, 3 * d, bias=bool(cfg.attention_bias))
        self.Wo = nn.Linear(d, d, bias=bool(cfg.attention_bias))


class _MLP(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        d, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
        self.Wi = nn.Linear(d, 2 * inter, bias=bool(cfg.mlp_bias))
        self.Wo = nn.Linear(inter, d, bias=bool(cfg.mlp_bias))


class _Layer(nn.Module):
    def __init__(self, cfg: Any, first: bool):
        super().__init__()
        d, eps, b = int(cfg.hidden_size), float(cfg.norm_eps), bool(cfg.norm_bias)
        self.attn_norm = nn.Identity() if first else _norm(d, eps, b)  # layer 0: identity, as in ModernBERT
        self.attn = _Attention(cfg)
        self.mlp_norm = _norm(d, eps, b)
        self.mlp = _MLP(cfg)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class NativeModernBert(nn.Module):
    """`encoder(input_ids, attention_mask).last_hidden_state` with ModernBERT's parameters and arithmetic."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.config = cfg
        if getattr(cfg, "hidden_activation", "gelu") != "gelu":
            raise ValueError("native ModernBERT implements exact GELU, got %r" % cfg.hidden_activation)
        self.embeddings = _Embeddings(cfg)
        self.layers = nn.ModuleList(_Layer(cfg, i == 0) for i in range(int(cfg.num_hidden_layers)))
        self.final_norm = _norm(int(cfg.hidden_size), float(cfg.norm_eps), bool(cfg.norm_bias))
        self.layer_types = list(layer_types(cfg))
        self.window = int(getattr(cfg, "sliding_window", None) or int(cfg.local_attention) // 2)
        tables = rope_tables(cfg)
        if tables is None:
            raise ValueError("native ModernBERT needs per-layer-type rope_parameters in the config")
        self.rope_types = sorted(tables)
        self.rope_scaling = [float(tables[t][1]) for t in self.rope_types]
        for t in self.rope_types:
            self.register_buffer("%s_inv_freq" % t, tables[t][0].float(), persistent=False)
        # the per-layer function; the compile backend's regional mode puts a compiled one here
        self.step: Any = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> EncoderOutput:
        L = input_ids.shape[1]
        emb = self.embeddings
        h = emb.norm(emb.tok_embeddings(input_ids))
        keep = attention_mask.bool()
        pos = torch.arange(L, device=input_ids.device)
        # boolean SDPA masks broadcast over heads: keys only on global layers; the window on local layers,
        # where a padding query (no key in its window may be real) attends everywhere, so it stays finite
        full = keep[:, None, None, :]
        near = (pos[None, :] - pos[:, None]).abs() <= self.window
        local = (near[None, None] & full) | ~keep[:, None, :, None]
        rope = {}
        for t, scale in zip(self.rope_types, self.rope_scaling):
            freqs = pos[:, None].float() * getattr(self, "%s_inv_freq" % t)[None, :]
            e = torch.cat((freqs, freqs), dim=-1)
            rope[t] = ((e.cos() * scale).to(h.dtype), (e.sin() * scale).to(h.dtype))
        step = self.step or layer_step
        eps = float(self.config.norm_eps)
        for layer, lt in zip(self.layers, self.layer_types):
            h = step(h, *rope[lt], full if lt == "full_attention" else local, layer_params(layer), eps,
                     layer.attn.heads, layer.attn.head_dim)
        return EncoderOutput(self.final_norm(h))


def layer_params(layer: _Layer) -> tuple[torch.Tensor | None, ...]:
    """One layer's tensors in `layer_step`'s order (None for an absent bias or layer 0's identity norm)."""
    an, a, mn, m = layer.attn_norm, layer.attn, layer.mlp_norm, layer.mlp
    return (getattr(an, "weight", None), getattr(an, "bias", None), a.Wqkv.weight, a.Wqkv.bias, a.Wo.weight,
            a.Wo.bias, mn.weight, mn.bias, m.Wi.weight, m.Wi.bias, m.Wo.weight, m.Wo.bias)


def layer_step(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
               p: tuple[torch.Tensor | None, ...], eps: float, heads: int, head_dim: int) -> torch.Tensor:
    """One pre-norm ModernBERT layer on the fp32 residual stream h [B, L, d]: RoPE attention under `mask`
    ([B, 1, 1, L] keys or [B, 1, L, L]), then the GeGLU MLP. A plain function of tensors (parameters
    included), so `torch.compile` builds one graph that every layer of a kind shares (the compile backend's
    regional mode)."""
    an_w, an_b, qkv_w, qkv_b, o_w, o_b, mn_w, mn_b, wi_w, wi_b, wo_w, wo_b = p
    d = h.shape[-1]
    x = h if an_w is None else F.layer_norm(h, (d,), an_w, an_b, eps)
    B, L, _ = x.shape
    q, k, v = F.linear(x, qkv_w, qkv_b).view(B, L, 3, heads, head_dim).unbind(dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = cos[None, None], sin[None, None]
    dt = q.dtype
    q = ((q.float() * cos) + (_rotate_half(q.float()) * sin)).to(dt)
    k = ((k.float() * cos) + (_rotate_half(k.float()) * sin)).to(dt)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=head_dim ** -0.5)
    h = h + F.linear(o.transpose(1, 2).reshape(B, L, -1), o_w, o_b)
    x = F.layer_norm(h, (d,), mn_w, mn_b, eps)
    a, gate = F.linear(x, wi_w, wi_b).chunk(2, dim=-1)
    return h + F.linear(F.gelu(a) * gate, wo_w, wo_b)


def load_native_model(bundle: Bundle) -> torch.nn.Module | None:
    """The DecisionModel with a `NativeModernBert` encoder, weights loaded strictly, or None when the checkpoint
    is not a ModernBERT this module can describe (then use `bundle.load_model`)."""
    from ..bundle import _no_param_init, build_head, verify

    ecfg = bundle.light_encoder_config()
    if ecfg is None:
        return None
    weights = load_weights(bundle.path)
    with _no_param_init():
        enc = NativeModernBert(ecfg)
    model = build_head(bundle, ecfg)
    model.encoder = enc
    verify(model, weights, bundle.path)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    buffers = {n for n, _ in model.named_buffers() if n.startswith(ENC)}
    missing = [m for m in missing if m not in buffers]
    if missing or unexpected:
        raise ValueError("Model architecture mismatch for %r: missing %s, unexpected %s"
                         % (bundle.path, missing[:5], unexpected[:5]))
    return model.float().eval().requires_grad_(False)


__all__ = ["NativeModernBert", "EncoderOutput", "layer_params", "layer_step", "layer_types", "load_native_model",
           "rope_tables"]
