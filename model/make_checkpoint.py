"""`laya-fleet make-checkpoint`: a complete Laya bundle with random weights and a real BPE tokenizer.

The tokenizer is a byte-level BPE trained offline on a corpus generated from a fixed word list and a
seeded RNG, so the same seed gives byte-identical files on any machine. Weights are random with real
layouts (ModernBERT encoder, 2-layer head, scorer, action head); the scorer's last layer is rescaled
so option probabilities are clearly non-uniform and argmax / |dp| comparisons mean something.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile

import torch

log = logging.getLogger(__name__)

SHAPES = {
    # hidden, layers, heads, intermediate, vocab rows, local rope theta, max_len, head_max_len
    "tiny": dict(hidden=128, layers=4, heads=2, ff=192, vocab=None, local_theta=10000.0,
                 max_len=512, head_max_len=192, tok_vocab=4096),
    "mmbert-base": dict(hidden=768, layers=22, heads=12, ff=1152, vocab=256000, local_theta=160000.0,
                        max_len=1024, head_max_len=256, tok_vocab=16384),
    "modernbert-large": dict(hidden=1024, layers=28, heads=16, ff=2624, vocab=50368, local_theta=10000.0,
                             max_len=512, head_max_len=192, tok_vocab=16384),
}
SPECIAL = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
# Temperatures shaped like the published English checkpoint (choice:11+ is clamped to 0.5 on load).
TEMPERATURE = [1.6369, 1.2514, 1.9834]
TEMPERATURE_BY_OPTIONS = {"choice:2": 1.9064, "choice:3-5": 1.7602, "choice:6-10": 1.0,
                          "choice:11+": 0.1006, "score:3-5": 1.2514, "noul:2": 1.9834}

_WORDS = """the of and to in is you that it he was for on are as with his they at be this have from or
one had by word but not what all were we when your can said there use an each which she do how their if
will up other about out many then them these so some her would make like him into time has look two more
write go see number no way could people my than first water been call who oil its now find long down day
did get come made may part customer order refund delivery late broken invoice payment account password
login error crash slow fast urgent angry happy thanks please help support ticket email subject dear regards
price plan upgrade cancel subscription shipping address product quality review spam offer free click link
security risk safe unsafe allowed blocked policy violation route model cheap frontier question answer yes
maybe true false level score choice state json user assistant message turn server database network timeout
bonjour merci commande livraison hallo danke bestellung hola gracias pedido ciao grazie ordine olá obrigado
こんにちは ありがとう 注文 你好 谢谢 订单 привет спасибо заказ مرحبا شكرا طلب नमस्ते धन्यवाद 안녕하세요 감사합니다
""".split()


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            words.append(rng.choice(["?", "!", ".", ",", ":", ";", "{", "}", "\"", "-"]))
        s = " ".join(words)
        out.append(s.capitalize() if rng.random() < 0.5 else s)
    return out


def train_tokenizer(seed: int, vocab_size: int):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained deterministically on generated text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def _write_json(path: str, obj) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _init_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Seeded random weights: norms near 1 (not exactly, so a mis-loaded norm shows), small matrices."""
    def rand(shape, std):
        return torch.randn(shape, generator=gen) * std

    for name, p in sorted(model.named_parameters()):
        if "norm" in name or name.startswith("scorer.0."):
            p.data.copy_(1.0 + rand(p.shape, 0.1) if name.endswith("weight") else rand(p.shape, 0.02))
        elif name.endswith("bias"):
            p.data.copy_(rand(p.shape, 0.02))
        elif p.dim() == 2 and "embeddings" not in name and "type_emb" not in name:
            # fan-in scaling: every layer changes the residual stream by O(1), so the states at
            # the option markers differ by context and random answers are well conditioned
            p.data.copy_(rand(p.shape, p.shape[1] ** -0.5))
        else:
            p.data.copy_(rand(p.shape, 1.0))


def make_checkpoint(out: str, shape: str = "tiny", seed: int = 0) -> str:
    """Write a complete bundle to `out` and return the path."""
    from transformers import ModernBertConfig, ModernBertModel

    from .network import DecisionModel

    if shape not in SHAPES:
        raise ValueError("unknown shape %r; use one of %s" % (shape, sorted(SHAPES)))
    s = SHAPES[shape]
    os.makedirs(os.path.join(out, "tokenizer"), exist_ok=True)
    os.makedirs(os.path.join(out, "encoder"), exist_ok=True)

    tok = train_tokenizer(seed, s["tok_vocab"])
    tok.save(os.path.join(out, "tokenizer", "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "mask_token": "[MASK]",
               "unk_token": "[UNK]"}
    _write_json(os.path.join(out, "tokenizer", "tokenizer_config.json"),
                dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=8192,
                     clean_up_tokenization_spaces=False,
                     **special))
    _write_json(os.path.join(out, "tokenizer", "special_tokens_map.json"), special)

    vocab = s["vocab"] or ((tok.get_vocab_size() + 63) // 64 * 64)
    layer_types = ["full_attention" if i % 3 == 0 else "sliding_attention" for i in range(s["layers"])]
    ecfg = ModernBertConfig(
        vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["ff"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], max_position_embeddings=8192, local_attention=128, layer_types=layer_types,
        rope_parameters={"full_attention": {"rope_theta": 160000.0, "rope_type": "default"},
                         "sliding_attention": {"rope_theta": s["local_theta"], "rope_type": "default"}},
        pad_token_id=ids["[PAD]"], cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"], bos_token_id=ids["[CLS]"],
        eos_token_id=ids["[SEP]"], architectures=["ModernBertModel"])
    ecfg.save_pretrained(os.path.join(out, "encoder"))

    gen = torch.Generator().manual_seed(seed)
    torch_state = torch.random.get_rng_state()
    enc = ModernBertModel(ecfg)
    model = DecisionModel(enc, head_layers=2, n_act=2).eval()
    torch.random.set_rng_state(torch_state)  # never leave the caller's RNG moved
    _init_(model, gen)
    _scale_scorer(model, tok, ids, gen)

    cfg = {"encoder": "answerdotai/ModernBERT-large" if shape != "mmbert-base" else "jhu-clsp/mmBERT-base",
           "head_layers": 2, "max_len": s["max_len"], "head_max_len": s["head_max_len"], "max_prefixes": 6,
           "act_costs": {"escalate": 0.5}, "cost_wrong_act": 3.0, "amp_dtype": "bf16", "model_name": "rl-agent",
           "temperature": TEMPERATURE, "temperature_by_options": TEMPERATURE_BY_OPTIONS,
           "training": {"generated_by": "laya-fleet make-checkpoint", "shape": shape, "seed": seed}}
    from safetensors.torch import save_file

    sd = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    tmp = os.path.join(out, "model.safetensors.tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(out, "model.safetensors"))
    _write_json(os.path.join(out, "rl_agent_config.json"), cfg)
    return out


@torch.no_grad()
def _scale_scorer(model, tok, ids, gen) -> None:
    """Rescale the scorer's output layer so option logits spread by about 2 (std) on sample rows."""
    rows = []
    for text in _corpus(1234, 32):
        body = tok.encode(text, add_special_tokens=False).ids
        opts = [tok.encode(" option %d %s" % (i, w), add_special_tokens=False).ids
                for i, w in enumerate(text.split()[:5])]
        seq = [ids["[CLS]"]] + tok.encode("choice question: pick", add_special_tokens=False).ids + [ids["[SEP]"]]
        markers = []
        for o in opts:
            markers.append(len(seq))
            seq += [ids["[MASK]"]] + o
        seq += [ids["[SEP]"]] + body + [ids["[SEP]"]]
        rows.append((seq, markers))
    L = max(len(r[0]) for r in rows)
    K = max(len(r[1]) for r in rows)
    inp = torch.full((len(rows), L), ids["[PAD]"], dtype=torch.long)
    att = torch.zeros((len(rows), L), dtype=torch.long)
    mpos = torch.zeros((len(rows), K), dtype=torch.long)
    mmask = torch.zeros((len(rows), K), dtype=torch.bool)
    for i, (seq, markers) in enumerate(rows):
        inp[i, :len(seq)] = torch.tensor(seq)
        att[i, :len(seq)] = 1
        mpos[i, :len(markers)] = torch.tensor(markers)
        mmask[i, :len(markers)] = True
    # Random weights give the marker features a large component shared by every option: removing it from the
    # output weights keeps logits moderate while keeping their spread across options (all a softmax reads)
    h = model.encoder(input_ids=inp, attention_mask=att).last_hidden_state
    h = h + model.type_emb(torch.zeros(len(rows), dtype=torch.long))[:, None, :]
    keep = att.bool()[:, None, None, :]
    for layer in model.head.layers:
        h = layer(h, keep)
    m = torch.gather(h, 1, mpos[:, :, None].expand(-1, -1, h.size(-1)))[mmask]
    feats = model.scorer[:3](m)
    mu = feats.mean(0)
    w = model.scorer[3].weight[0]
    w.sub_(mu * (w @ mu) / (mu @ mu))
    per_row = torch.zeros(mmask.shape)
    per_row[mmask] = feats @ w
    centred = (per_row - per_row.sum(-1, keepdim=True) / mmask.sum(-1, keepdim=True))[mmask]
    spread = float(centred.std())
    if spread > 0:
        w.mul_(2.0 / spread)
    log.info("scorer output scaled by %.3g (row spread %.3g)", 2.0 / max(spread, 1e-12), spread)
    model.scorer[3].bias.fill_(-float((feats @ w).mean()))
