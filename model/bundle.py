"""Checkpoint bundles on disk: `rl_agent_config.json`, `model.safetensors`, `tokenizer/`, `encoder/`.

Published Laya checkpoints load unchanged from a directory: nothing in the directory is rewritten
(it may be a read-only mount), the tokenizer is built from `tokenizer.json` plus the special tokens
named in its config, and the model is built without random initialisation, then loaded strictly. Reading a
bundle (config, tokenizer) imports no torch: processes that only tokenize and decode stay light.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CONFIG = "rl_agent_config.json"
WEIGHTS = "model.safetensors"
REQUIRED_PREFIXES = ("encoder.", "type_emb.", "scorer.", "act_head.")
_SPECIAL = ("cls_token", "sep_token", "pad_token", "mask_token", "unk_token")


@dataclass
class Bundle:
    """A checkpoint directory's parsed contents (config, encoder config, tokenizer).

    `encoder_config` (transformers' config object) is built on first use: importing transformers'
    auto classes is slow, and the codec (tokenizer only) and the plain-torch encoders (`light_encoder_config`)
    never need it.
    """

    path: str
    cfg: dict
    encoder_dict: dict
    tokenizer: Any
    _encoder_config: Any = field(default=None, repr=False, compare=False)

    @property
    def encoder_config(self) -> Any:
        """transformers' config of the encoder (from `encoder/config.json`, with the RoPE fix-up)."""
        if self._encoder_config is None:
            self._encoder_config = load_encoder_config(self.path, self.cfg)
        return self._encoder_config

    def light_encoder_config(self) -> SimpleNamespace | None:
        """The encoder config as plain attributes straight from `encoder/config.json`, without transformers, or
        None when the file does not state every value the fast backend reads (then use `encoder_config`,
        which fills transformers' defaults)."""
        return light_encoder_config(self.encoder_dict)

    @property
    def max_len(self) -> int:
        """Total token budget per row."""
        return int(self.cfg.get("max_len", 512))

    @property
    def head_max_len(self) -> int:
        """Token budget for instructions + options."""
        return int(self.cfg.get("head_max_len", 192))


def read_config(path: str) -> dict:
    """The checkpoint's `rl_agent_config.json`; FileNotFoundError / ValueError say what is wrong."""
    f = os.path.join(path, CONFIG)
    if not os.path.isfile(f):
        raise FileNotFoundError("Incompatible model: %r does not contain %r" % (path, CONFIG))
    cfg = _json_object(f)
    missing = [k for k in ("encoder", "head_layers") if k not in cfg]
    if missing:
        raise ValueError("Incompatible model config for %r: missing configuration keys %s" % (path, missing))
    return cfg


def apply_rope_config(ecfg: Any) -> None:
    """Copy transformers-5 `rope_parameters` onto `global_rope_theta` / `local_rope_theta`."""
    rope = getattr(ecfg, "rope_parameters", None)
    if not isinstance(rope, dict):
        return
    flat = rope.get("rope_theta")
    for layer_type, attr in (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")):
        params = rope.get(layer_type)
        theta = params.get("rope_theta") if isinstance(params, dict) else flat
        if theta is not None and hasattr(ecfg, attr):
            setattr(ecfg, attr, float(theta))


def read_encoder_dict(path: str) -> dict:
    """`encoder/config.json` as a dict (never downloaded); FileNotFoundError / ValueError say what is wrong."""
    f = os.path.join(path, "encoder", "config.json")
    if not os.path.isfile(f):
        raise FileNotFoundError("Incompatible model: %r has no encoder/config.json; bundles must carry "
                                "their encoder config (nothing is downloaded)" % path)
    return _json_object(f)


def _json_object(f: str) -> dict:
    """The JSON object in file `f`; ValueError naming the file when it is not valid JSON or not an object."""
    with open(f, encoding="utf-8") as fh:
        try:
            data = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError("Incompatible model: %s is not valid JSON (%s)" % (f, e)) from None
    if not isinstance(data, dict):
        raise ValueError("Incompatible model: %s must hold a JSON object" % f)
    return data


def load_encoder_config(path: str, cfg: dict) -> Any:
    """The encoder's HF config, from `encoder/` (never downloaded), with the RoPE fix-up applied."""
    from transformers import AutoConfig

    read_encoder_dict(path)  # the clear error for a missing / broken file
    ecfg = AutoConfig.from_pretrained(os.path.join(path, "encoder"))
    apply_rope_config(ecfg)
    return ecfg


# what the plain-torch encoders read from a ModernBERT config (model/backends/fast/weights.py, torch_encoder.py)
LIGHT_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
              "norm_eps", "local_attention", "layer_types", "rope_parameters")
LIGHT_OPTIONAL = {"hidden_activation": "gelu", "mlp_bias": False, "norm_bias": False, "attention_bias": False,
                  "max_position_embeddings": 8192}  # transformers' ModernBertConfig defaults


def light_encoder_config(data: dict) -> SimpleNamespace | None:
    """A ModernBERT `config.json` dict as plain attributes, or None unless it states every value the fast
    backend reads (`LIGHT_KEYS`; a few booleans / the activation default as transformers' ModernBertConfig
    does) in transformers-5 form (`layer_types`, per-layer-type `rope_parameters`)."""
    if data.get("model_type") != "modernbert" or any(k not in data for k in LIGHT_KEYS):
        return None
    ints = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
            "local_attention")
    if any(not isinstance(data[k], int) or isinstance(data[k], bool) or data[k] <= 0 for k in ints):
        return None  # odd values: transformers' config (and its errors) decide
    if data["hidden_size"] % data["num_attention_heads"]:
        return None
    types, rope = data["layer_types"], data["rope_parameters"]
    if (not isinstance(types, list) or len(types) != data["num_hidden_layers"]
            or not isinstance(rope, dict) or any(not isinstance(rope.get(t), dict) for t in set(types))):
        return None
    if any(rope[t].get("rope_type", "default") != "default" or "rope_theta" not in rope[t] for t in set(types)):
        return None  # scaled RoPE: transformers' init functions need its config object
    ns = SimpleNamespace(**{**LIGHT_OPTIONAL, **data})
    ns.sliding_window = int(data["local_attention"]) // 2
    return ns


def load_tokenizer(path: str, cache: bool = True) -> Any:
    """The tokenizer of `tokenizer/tokenizer.json` with special tokens from its config files: transformers'
    `PreTrainedTokenizerFast`, behind `model.tokenizer.Tokenizer`, which reads what the codec needs from the
    node-local cache without importing transformers when an earlier process recorded it (`cache`)."""
    from . import tokenizer as _tokenizer

    tok_dir = os.path.join(path, "tokenizer")
    tok_file = os.path.join(tok_dir, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError("Incompatible model: %r has no tokenizer/tokenizer.json" % path)
    special: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        f = os.path.join(tok_dir, name)
        if not os.path.isfile(f):
            continue
        with open(f, encoding="utf-8") as fh:
            data = json.load(fh)
        for key in _SPECIAL:
            val = data.get(key)
            if isinstance(val, dict):
                val = val.get("content")
            if isinstance(val, str) and key not in special:
                special[key] = val
    for key, default in (("cls_token", "[CLS]"), ("sep_token", "[SEP]"), ("pad_token", "[PAD]"),
                         ("mask_token", "[MASK]"), ("unk_token", "[UNK]")):
        special.setdefault(key, default)
    tok = _tokenizer.load(tok_file, special, cache=cache)
    for key in ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id"):
        if getattr(tok, key) is None:
            raise ValueError("Incompatible model: tokenizer in %r has no %s" % (path, key[:-3]))
    return tok


def open_bundle(path: str) -> Bundle:
    """Parse a checkpoint directory without touching its weights."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError("checkpoint directory %r does not exist" % path)
    cfg = read_config(path)
    return Bundle(path, cfg, read_encoder_dict(path), load_tokenizer(path))


@contextmanager
def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def build_model(bundle: Bundle) -> torch.nn.Module:
    """A DecisionModel with uninitialised parameters, ready for a strict load.

    The encoder is allocated under transformers' `no_init_weights` (its non-persistent RoPE buffers
    must stay real); the head modules are created on the meta device and materialised empty, so no
    initialisation kernel runs and no RNG is consumed.
    """
    from transformers import AutoModel

    with _no_init():
        enc = AutoModel.from_config(bundle.encoder_config, attn_implementation="sdpa")
    model = build_head(bundle, enc.config)
    model.encoder = enc
    return model


def _encoder_stand_in(config: Any) -> torch.nn.Module:
    """A parameterless module holding the encoder config while the head is built (it reads only
    `encoder.config`)."""
    import torch

    stand_in = torch.nn.Module()
    stand_in.config = config
    return stand_in


def build_head(bundle: Bundle, encoder_config: Any) -> torch.nn.Module:
    """A DecisionModel whose head, scorer and act head are allocated empty on the CPU (no initialisation
    kernel, no RNG) and whose `encoder` is a parameterless stand-in holding `encoder_config`."""
    from .network import DecisionModel

    with _no_param_init():
        return DecisionModel(_encoder_stand_in(encoder_config), int(bundle.cfg.get("head_layers", 2)),
                             len(bundle.cfg.get("act_costs", {})) + 1)


_INIT_LOCK = threading.Lock()
_INIT_FNS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
             "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextmanager
def _no_param_init():
    """torch.nn.init's in-place initialisers as no-ops: modules built inside keep `torch.empty` memory (no
    kernel, no RNG). Building on the meta device instead costs the first import of torch._dynamo (seconds on
    a GPU host: the meta initialisers run through torch._refs under a dynamo-disable wrapper)."""
    import torch

    init = torch.nn.init
    with _INIT_LOCK:  # process-wide, like transformers' no_init_weights: our own builders take turns
        saved = {n: getattr(init, n) for n in _INIT_FNS if hasattr(init, n)}
        try:
            for n in saved:
                setattr(init, n, lambda tensor, *a, **k: tensor)
            yield
        finally:
            for n, fn in saved.items():
                setattr(init, n, fn)


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict from `model.safetensors`."""
    from safetensors.torch import load_file

    f = os.path.join(path, WEIGHTS)
    if not os.path.isfile(f):
        raise FileNotFoundError("Incompatible model: %r does not contain %r" % (path, WEIGHTS))
    return load_file(f)


def verify(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: str) -> None:
    """Raise ValueError naming what does not match between checkpoint weights and architecture."""
    for prefix in REQUIRED_PREFIXES:
        if not any(k.startswith(prefix) for k in weights):
            raise ValueError("Incompatible model weights for %r: checkpoint is missing %r parameters"
                             % (path, prefix))
    bad, missing = [], []
    for name, p in model.named_parameters():
        if name not in weights:
            missing.append(name)
        elif tuple(weights[name].shape) != tuple(p.shape):
            bad.append("%s: expected %s, found %s" % (name, tuple(p.shape), tuple(weights[name].shape)))
    if bad:
        raise ValueError("Model architecture mismatch for %r: %s%s" % (
            path, "; ".join(bad[:5]), " ... and %d more" % (len(bad) - 5) if len(bad) > 5 else ""))
    if missing:
        raise ValueError("Model weights incomplete for %r: missing %d parameter tensors (e.g. %s)"
                         % (path, len(missing), missing[:3]))


def load_model(bundle: Bundle) -> torch.nn.Module:
    """Build the model and load `model.safetensors` strictly, as fp32 on CPU, in eval mode."""
    model = build_model(bundle)
    weights = load_weights(bundle.path)
    verify(model, weights, bundle.path)
    model.load_state_dict(weights, strict=True)
    return model.float().eval().requires_grad_(False)


def checkpoint_hash(path: str) -> str:
    """A short content hash of a checkpoint (config + weights + tokenizer), for cache keys."""
    h = hashlib.sha256()
    for rel in (CONFIG, WEIGHTS, "tokenizer/tokenizer.json", "encoder/config.json"):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            continue
        st = os.stat(f)
        h.update(("%s:%d:" % (rel, st.st_size)).encode())
        with open(f, "rb") as fh:
            if st.st_size <= 64 << 20:
                h.update(fh.read())
            else:  # big weights: head, middle and tail are enough to tell checkpoints apart
                for off in (0, st.st_size // 2, max(0, st.st_size - (8 << 20))):
                    fh.seek(off)
                    h.update(fh.read(8 << 20))
    return h.hexdigest()[:16]
