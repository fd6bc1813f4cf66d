"""The model exports with torch.export and no autocast (the dtype-explicit action head)."""

from __future__ import annotations

import torch

from model.backends.base import collate

from .cases import cases


def test_torch_export_without_autocast_matches_eager(engine):
    states, qs = cases(3, seed=2)[2]
    p = engine.prepare(qs)
    rows = [r for e in engine.encode_many(states, p) for r in e.rows]
    b = collate(rows, engine.builder.pad_id)
    args = (b["input_ids"], b["attention_mask"], b["marker_pos"], b["marker_mask"], b["qtype"])
    m = engine.backend.model
    assert not torch.is_autocast_enabled("cpu")
    with torch.no_grad():
        ep = torch.export.export(m, args)
        got = ep.module()(*args)
        want = m(*args)
    assert torch.allclose(got[0], want[0], atol=1e-4) and torch.allclose(got[1], want[1], atol=1e-5)


def test_bf16_model_runs_without_autocast(engine):
    """A bf16 copy runs end to end with no autocast: the act-head input follows its weights' dtype."""
    import copy

    m = copy.deepcopy(engine.backend.model).to(torch.bfloat16)
    p = engine.prepare({"q": {"type": "choice", "instructions": "pick", "criteria": ["a", "b", "c"]}})
    b = collate(engine.encode("some state text", p).rows, engine.builder.pad_id)
    with torch.no_grad():
        logits, act = m(b["input_ids"], b["attention_mask"], b["marker_pos"], b["marker_mask"], b["qtype"])
    assert logits.dtype == torch.float32 and act.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()
