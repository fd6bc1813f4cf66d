"""The fast backend's weights: a weights-only DecisionModel read from the checkpoint, and its copy on the device.

The fast backend only reads the encoder's weights and config: it runs its own kernels, so it skips building
transformers' `ModernBertModel` (whose import is most of a warm replica's load time; see BENCHMARKS.md, "Warm
start"). `load_fast_model` builds the encoder as a tree of plain attributes over the safetensors tensors,
with the names and shapes the transformers module has (`encoder.layers.3.attn.Wqkv.weight`, ...) plus the
per-layer-type RoPE inverse frequencies it would compute; the decision head, scorer and act head are this
project's own torch modules (model/network.py), loaded strictly as always.

`load_fast_model` returns None where the checkpoint is not one it can describe (another encoder family, no
`rope_parameters` in the config, e.g. transformers 4.x): the caller then loads the full model. `DeviceWeights`
copies either model's tensors to the device in the layout the forward reads.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import torch

from kernels import attention as _attn
from kernels import ln_fold as _lnf
from kernels import rope as _rope
from model.backends.base import BackendUnavailable
from model.backends.torch_encoder import rope_tables
from model.bundle import Bundle, load_weights

from . import fp8 as _fp8

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
    from model.bundle import build_head, verify

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
    # the checkpoint's dtype: DeviceWeights converts on the device (a host-side fp32 copy of a large encoder
    # cost a second of CPU and twice the bytes to copy)
    enc = _tree({k: v for k, v in weights.items() if k.startswith(ENC)}, ENC)
    enc.config = ecfg
    enc.rotary_emb = WeightTree(**{"%s_inv_freq" % lt: inv for lt, (inv, _) in rope.items()},
                                **{"%s_attention_scaling" % lt: s for lt, (_, s) in rope.items()})
    object.__setattr__(model, "encoder", enc)  # not a submodule: plain tensors the fast path copies out
    model.weights_only = True
    return model


SCORER_PAD = 16   # the scorer's 1-wide output layer runs as a 16-wide GEMM (zero rows) with fp32 output


class _Layer:
    """Weights of one encoder or head layer on the device (GEMM weights in the activation dtype, or an encoder's
    as fp8.Fp8Weight under the FP8 precision; norms and biases fp32; with the add+LayerNorm fold, cs_qkv / cs_i: the
    row sums of Wqkv / Wi, which then carry the norms' scales)."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


class DeviceWeights:
    """The weights part of `FastForward`: every tensor the forward reads, on its device, plus the model's dims."""

    def _load_weights(self, model: torch.nn.Module, bundle: Any) -> None:
        enc = model.encoder
        cfg = enc.config
        if getattr(cfg, "model_type", None) != "modernbert":
            raise BackendUnavailable("the fast path implements ModernBERT-family encoders, got %r"
                                     % getattr(cfg, "model_type", None))
        d, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
        if d % heads or d // heads != _attn.HEAD_DIM:
            raise BackendUnavailable("the kernels need head_dim 64, got %d / %d" % (d, heads))
        if getattr(cfg, "hidden_activation", "gelu") != "gelu":
            raise BackendUnavailable("the GeGLU kernel implements exact GELU, got %r" % cfg.hidden_activation)
        if getattr(cfg, "mlp_bias", False):
            raise BackendUnavailable("the GeGLU kernel has no bias (mlp_bias=True)")
        if model.head is None or d % 64:
            raise BackendUnavailable("the fast path needs the decision head with d a multiple of 64")
        dev, adt = self.device, self.act_dtype
        self.d, self.heads, self.inter = d, heads, int(cfg.intermediate_size)
        self.head_heads = max(1, d // 64)
        self.eps = float(cfg.norm_eps)
        positions = getattr(cfg, "max_position_embeddings", None)
        positions = positions if isinstance(positions, int) and not isinstance(positions, bool) else bundle.max_len
        self.max_len = min(int(bundle.max_len), positions)   # the checkpoint's row: warm-up rows, marker capacity
        # a row may run to the encoder's position range, as the eager forward and upstream's server take a body
        # max_len above the checkpoint's (Packing.max_row_tokens also bounds it by the buffers)
        self.max_positions = max(self.max_len, positions)
        window = getattr(cfg, "sliding_window", None) or int(cfg.local_attention) // 2

        def w(t: torch.Tensor) -> torch.Tensor:   # copied in the checkpoint's dtype, converted on the device
            return t.detach().to(dev).to(adt).contiguous()

        def e(t: torch.Tensor) -> Any:   # an encoder GEMM weight: e4m3 with per-channel scales under fp8
            return _fp8.quantize_weight(t.detach().to(dev)) if self.fp8 else w(t)

        def f(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(dev).float().contiguous()

        # the tuning table's add+LayerNorm fold (kernels/ln_fold.py): the encoder's norms keep a unit scale and the
        # GEMMs after them take W * gamma, in every bucket; FP8 and norms with a shift keep the plain weights
        enc_norms = [x.attn_norm for x in enc.layers[1:]] + [x.mlp_norm for x in enc.layers]
        self.fold = bool(self.tuning.ln_fold_m) and not self.fp8 and \
            all(getattr(x, "bias", None) is None for x in enc_norms)
        ones = torch.ones(d, device=dev)

        def n(norm: Any, t: torch.Tensor) -> tuple[Any, Any, Any]:   # (norm, GEMM weight, its row sums) after a norm
            if norm is None:
                return None, e(t), None
            if not self.fold:
                return (f(norm.weight), f(getattr(norm, "bias", None))), e(t), None
            return ((ones, None),) + _lnf.prepare(t.detach().to(dev), f(norm.weight), adt)

        emb = enc.embeddings
        self.emb = f(emb.tok_embeddings.weight)
        self.emb_norm = (f(emb.norm.weight), f(getattr(emb.norm, "bias", None)))
        rot = enc.rotary_emb
        self.rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        types = list(cfg.layer_types)
        for lt in sorted(set(types)):
            inv = getattr(rot, "%s_inv_freq" % lt)
            scaling = float(getattr(rot, "%s_attention_scaling" % lt, 1.0))
            self.rope_tables[lt] = _rope.rope_tables_from_inv_freq(inv, self.max_positions, scaling, dev)
        self.layers = []
        for i, layer in enumerate(enc.layers):
            attn_norm, wqkv, cs_qkv = n(layer.attn_norm if i > 0 else None, layer.attn.Wqkv.weight)
            mlp_norm, wi, cs_i = n(layer.mlp_norm, layer.mlp.Wi.weight)
            self.layers.append(_Layer(
                attn_norm=attn_norm, wqkv=wqkv, cs_qkv=cs_qkv, bqkv=f(layer.attn.Wqkv.bias),
                wo=e(layer.attn.Wo.weight), bo=f(layer.attn.Wo.bias),
                mlp_norm=mlp_norm, wi=wi, cs_i=cs_i, wo2=e(layer.mlp.Wo.weight), bo2=f(layer.mlp.Wo.bias),
                window=int(window) if types[i] == "sliding_attention" else 0, rope=types[i]))
        fn = enc.final_norm
        self.final_norm = (f(fn.weight), f(getattr(fn, "bias", None)))
        self.head_layers = []
        for hl in model.head.layers:
            a = hl.self_attn
            self.head_layers.append(_Layer(
                norm1=(f(hl.norm1.weight), f(hl.norm1.bias), float(hl.norm1.eps)),
                norm2=(f(hl.norm2.weight), f(hl.norm2.bias), float(hl.norm2.eps)),
                win=w(a.in_proj_weight), bin=f(a.in_proj_bias), wout=w(a.out_proj.weight), bout=f(a.out_proj.bias),
                w1=w(hl.linear1.weight), b1=f(hl.linear1.bias), w2=w(hl.linear2.weight), b2=f(hl.linear2.bias)))
        self.ffn = int(model.head.layers[0].linear1.out_features)
        sc = model.scorer
        self.scorer_norm = (f(sc[0].weight), f(sc[0].bias), float(sc[0].eps))
        self.scorer_w1, self.scorer_b1 = w(sc[1].weight), f(sc[1].bias)
        w2 = torch.zeros(SCORER_PAD, d)
        w2[0] = sc[3].weight.detach().float()[0]
        b2 = torch.zeros(SCORER_PAD)
        b2[0] = sc[3].bias.detach().float()[0]
        self.scorer_w2, self.scorer_b2 = w(w2), f(b2)
        self.type_emb = f(model.type_emb.weight)
        self.act_head = copy.deepcopy(model.act_head).float().to(dev).eval().requires_grad_(False)


__all__ = ["WeightTree", "DeviceWeights", "load_fast_model", "expected_encoder_shapes", "SCORER_PAD"]
