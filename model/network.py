"""The DecisionModel: a ModernBERT-family encoder, a 2-layer decision head, a scorer and an action head.

Parameter names and shapes match upstream Laya checkpoints exactly (`encoder.*`, `head.layers.i.*`,
`type_emb.*`, `scorer.*`, `act_head.*`, the `temperature` buffer), so a published `model.safetensors`
loads strictly. The head is written out explicitly (no `nn.TransformerEncoderLayer` fast path) and
every dtype is explicit, so the model exports with `torch.export` and packages with AOTInductor
without autocast.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class HeadAttention(nn.Module):
    """Multi-head self-attention with a packed input projection (upstream `self_attn` names)."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.num_heads = n_heads
        self.head_dim = d // n_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d, d))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * d))
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """x [N,L,d]; keep [N,1,1,L] bool (True = real key) or None."""
        n, length, _ = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2) for t in qkv.chunk(3, -1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out_proj(o.transpose(1, 2).flatten(-2))


def _native_layer_ok(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu")
            and not isinstance(x, torch.fx.Proxy) and type(x) is torch.Tensor)


class HeadLayer(nn.Module):
    """A pre-norm transformer layer with ReLU feed-forward (upstream head layer names)."""

    def __init__(self, d: int, n_heads: int, ff: int):
        super().__init__()
        self.self_attn = HeadAttention(d, n_heads)
        self.linear1 = nn.Linear(d, ff)
        self.linear2 = nn.Linear(ff, d)
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if _native_layer_ok(x):
            # CPU inference: torch's fused encoder-layer kernel, the one nn.TransformerEncoderLayer
            # (and so upstream Laya) runs here, so fp32 answers match the reference bit for bit.
            a = self.self_attn
            pad = None if keep is None else ~keep[:, 0, 0, :]
            return torch._transformer_encoder_layer_fwd(
                x, x.size(-1), a.num_heads, a.in_proj_weight, a.in_proj_bias, a.out_proj.weight,
                a.out_proj.bias, False, True, self.norm1.eps, self.norm1.weight, self.norm1.bias,
                self.norm2.weight, self.norm2.bias, self.linear1.weight, self.linear1.bias,
                self.linear2.weight, self.linear2.bias, pad, None if pad is None else 1)
        x = x + self.self_attn(self.norm1(x), keep)
        return x + self.linear2(F.relu(self.linear1(self.norm2(x))))


class Head(nn.Module):
    """The decision head stack; `layers` matches upstream's `head.layers.i` naming."""

    def __init__(self, d: int, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(HeadLayer(d, max(1, d // 64), 4 * d) for _ in range(n_layers))


def confidence_features(logits: torch.Tensor, marker_mask: torch.Tensor) -> torch.Tensor:
    """[top1, top1 - top2, normalised entropy, k/255] per row, from masked logits (fp32)."""
    p = torch.softmax(logits, -1)
    k = marker_mask.sum(-1).clamp(min=2).float()
    ent = -(p * torch.log(p.clamp_min(1e-9))).sum(-1) / torch.log(k)
    if p.size(-1) >= 2:
        top = p.topk(2, -1).values
        top1, top2 = top[:, 0], top[:, 1]
    else:  # one option: fully decided
        top1 = p[:, 0]
        top2 = torch.zeros_like(top1)
    return torch.stack([top1, top1 - top2, ent, k / 255.0], -1)


class DecisionModel(nn.Module):
    """Encoder + type embedding + decision head + scorer + action head."""

    def __init__(self, encoder: nn.Module, head_layers: int = 2, n_act: int = 2):
        super().__init__()
        self.encoder = encoder
        d = encoder.config.hidden_size
        self.hidden_size = d
        self.head = Head(d, head_layers) if head_layers > 0 else None
        self.type_emb = nn.Embedding(3, d)
        self.scorer = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))
        self.act_head = nn.Sequential(nn.Linear(d + 4, 256), nn.GELU(), nn.Linear(256, n_act))
        self.register_buffer("temperature", torch.ones(3))

    def head_and_scores(self, h: torch.Tensor, attention_mask: torch.Tensor, marker_pos: torch.Tensor,
                        marker_mask: torch.Tensor, qtype: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From encoder states [N,L,d] to (option logits [N,K] fp32, action logits [N,A])."""
        wdtype = self.type_emb.weight.dtype
        h = h.to(wdtype) + self.type_emb(qtype)[:, None, :]
        if self.head is not None:
            keep = attention_mask.bool()[:, None, None, :]
            for layer in self.head.layers:
                h = layer(h, keep)
        idx = marker_pos.clamp(min=0)[:, :, None].expand(-1, -1, h.size(-1))
        m = torch.gather(h, 1, idx)
        logits = self.scorer(m).squeeze(-1).float().masked_fill(~marker_mask, -1e4)
        feats = confidence_features(logits, marker_mask)
        act_in = torch.cat([h[:, 0].float(), feats], -1).to(self.act_head[0].weight.dtype)
        return logits, self.act_head(act_in)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, marker_pos: torch.Tensor,
                marker_mask: torch.Tensor, qtype: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded batch in, (option logits [N,K] fp32, action logits [N,A]) out."""
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head_and_scores(h, attention_mask, marker_pos, marker_mask, qtype)


def head_flops_per_token(d: int, layers: int) -> float:
    """Matmul FLOPs per token of the decision head (attention score/value terms excluded)."""
    return layers * 2.0 * (3 * d * d + d * d + 8 * d * d)


def encoder_flops_per_token(d: int, layers: int, ff: int) -> float:
    """Matmul FLOPs per token of a ModernBERT encoder (projections only)."""
    return layers * 2.0 * (3 * d * d + d * d + 2 * ff * d + ff * d)


__all__ = ["DecisionModel", "Head", "HeadLayer", "HeadAttention", "confidence_features",
           "head_flops_per_token", "encoder_flops_per_token"]
