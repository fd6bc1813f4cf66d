"""The public engine: load a checkpoint once, then answer questions about states.

The pipeline is split so that serving can run each stage where it belongs: `prepare` validates a
question set (once per request), `encode` tokenizes a state into rows (CPU), `score` runs the
backend forward (GPU), and `decode` builds the answer JSON (CPU). The CPU stages are the weightless
`model.codec.Codec`'s; `predict` / `predict_batch` chain them in-process with the same results as
upstream `laya` 0.4.15.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import abstention as _abstention
from . import decode as _decode
from .bundle import Bundle, checkpoint_hash, load_model, open_bundle
from .codec import Codec, Prepared
from .sequence import EncodedState, Row

log = logging.getLogger(__name__)

__all__ = ["Engine", "Prepared", "load", "resolve_device", "row_token_limit"]


class Engine:
    """A loaded checkpoint plus a backend; thread-safe for concurrent `predict*` calls."""

    def __init__(self, bundle: Bundle, backend: Any):
        self.bundle = bundle
        self.backend = backend
        # a packed backend stages rows from their int32 arrays (Row.arr)
        self.codec = Codec(bundle, row_token_limit(bundle, backend), row_arrays=bool(backend.packed))
        self.builder = self.codec.builder
        self.temperatures = self.codec.temperatures
        # predict_batch's tokenizing ahead (its thread starts at the first multi-window call)
        self._encode_pool = ThreadPoolExecutor(1, thread_name_prefix="laya-encode")
        # and its decoding behind the device (a thread from the first call with more than one chunk)
        self._decode_pool = ThreadPoolExecutor(1, thread_name_prefix="laya-decode")
        self._hash: str | None = None

    # -- facts --------------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The checkpoint directory."""
        return self.bundle.path

    @property
    def backend_name(self) -> str:
        """Which forward implementation runs (`eager`, `fast`, `compile`, `aot`)."""
        return self.backend.name

    @property
    def device(self) -> torch.device:
        """The device the forward runs on."""
        return self.backend.device

    @property
    def checkpoint_hash(self) -> str:
        """A short content hash of the checkpoint (cache keys)."""
        if self._hash is None:
            self._hash = checkpoint_hash(self.bundle.path)
        return self._hash

    # -- stages -------------------------------------------------------------------------------
    def prepare(self, questions: Any, max_len: int | None = None, head_max_len: int | None = None) -> Prepared:
        """The validated question set with its heads (`Codec.prepare`); ValueError names a bad question."""
        return self.codec.prepare(questions, max_len, head_max_len)

    def encode(self, state: Any, prepared: Prepared, state_ids: list[int] | None = None) -> EncodedState:
        """Rows for one state (TypeError for a None state; ValueError if options do not fit)."""
        return self.codec.encode(state, prepared, state_ids)

    def encode_many(self, states: Sequence[Any], prepared: Prepared) -> list[EncodedState]:
        """Rows for many states; the states are tokenized in one parallel batch."""
        return self.codec.encode_many(states, prepared)

    def score(self, rows: Sequence[Row], max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Backend forward over rows: (logits [N, kmax], P(action 0) [N]). `max_tokens` caps the chunks of a
        backend that cuts its own (`backend.chunk_tokens` not None); others score rows as one batch."""
        if max_tokens is None:
            return self.backend.forward(rows)
        return self.backend.forward(rows, max_tokens=max_tokens)

    def launch(self, rows: Sequence[Row]):
        """`score(rows)` queued on the device without waiting, for a caller that polls rather than blocks: an
        object with `ready()` (done, without waiting) and `collect()` (waits; `score`'s result), which the caller
        must collect. None when the backend cannot (only the fast backend's own class queues one chunk; a wrapper
        around it, as fault injection installs, is always called through `score`)."""
        launch = getattr(type(self.backend), "launch", None)
        return launch(self.backend, rows) if launch is not None else None

    def decode(self, prepared: Prepared, enc: EncodedState, logits: np.ndarray, act_p0: np.ndarray) -> dict:
        """The answer JSON for one state from its rows' outputs."""
        return self.codec.decode(prepared, enc, logits, act_p0)

    # -- in-process API -----------------------------------------------------------------------
    def predict(self, state: Any, questions: Any, **kw: Any) -> dict:
        """The answer JSON for one state; same result as upstream `Agent.predict`, including its `min_confidence`
        gate (`model.abstention`); takes `predict_batch`'s keywords."""
        if isinstance(state, (bytes, bytearray)):
            raise TypeError("state must be a string, dict, or list, got bytes")
        return self.predict_batch([state], questions, **kw)[0]

    def predict_batch(self, states: Sequence[Any], questions: Any, batch_size: int | None = None,
                      sort_by_length: bool = False, max_len: int | None = None,
                      head_max_len: int | None = None, min_confidence: Any = None) -> list[dict]:
        """One answer JSON per state for the same questions, `batch_size` states per forward (None = all);
        `min_confidence` (a number in [0, 1] or a per-bucket map, validated first: ValueError with upstream's
        text) gates the answers as upstream does (`model.abstention.apply`)."""
        threshold = _abstention.check_optional(min_confidence)
        if isinstance(states, (str, bytes, dict)):
            raise TypeError("predict_batch expects a list of states; pass a single state to predict()")
        if not isinstance(questions, dict):
            raise TypeError("questions must be a dict of question id -> definition, got %s"
                            % type(questions).__name__)
        states = list(states)
        if any(s is None for s in states):
            raise TypeError("state must not be None; pass a string, dict, or list")
        if not states:
            return []
        if not questions:
            return [_decode.empty_result() for _ in states]
        prepared = self.prepare(questions, max_len, head_max_len)
        n = len(states)
        chunk = batch_size if (batch_size and batch_size > 0) else n
        # a packed backend pads no row to the longest, so sorting gains it nothing: its windows stay one chunk,
        # and each is tokenized while the one before it is on the device
        reorder = sort_by_length and 1 < chunk < n and not self.backend.packed
        bounds = list(range(0, n, chunk * 8 if reorder else chunk)) + [n]
        lead = len(bounds) == 2 and self.backend.packed and n >= LEAD_MIN_STATES
        if lead:
            # one forward for all: the first states go ahead alone, so the rest are tokenized under their forward
            bounds = [0, -(-n // LEAD_PARTS), n]
        # each chunk's answers are decoded on a worker thread while the next chunk scores (the last one here)
        results: list[dict | None] = [None] * n
        decoding = []
        windows = list(zip(bounds, bounds[1:]))
        walk = zip(windows, self._encoded([states[a:b] for a, b in windows], prepared))
        for (start, end), encoded in walk:
            if lead and start == 0 and sum(len(r) for e in encoded for r in e.rows) < LEAD_MIN_TOKENS:
                # too few tokens ahead for a forward of their own to pay: one forward after all
                (_, end), rest = next(walk)
                encoded = encoded + rest
            order = list(range(len(encoded)))
            step = chunk if reorder else len(order)
            if reorder:
                order.sort(key=lambda i: encoded[i].max_len)
            for off in range(0, len(order), step):
                idx = order[off:off + step]
                logits, act = self.score([r for i in idx for r in encoded[i].rows])
                args = (results, start, prepared, encoded, idx, logits, act)
                if end >= n and off + step >= len(order):
                    self._decode_into(*args)
                else:
                    decoding.append(self._decode_pool.submit(self._decode_into, *args))
        for f in decoding:
            f.result()
        _abstention.apply(results, threshold)
        return results  # type: ignore[return-value]

    def _decode_into(self, out: list, start: int, prepared: Prepared, encoded: list[EncodedState], idx: list[int],
                     logits: np.ndarray, act: np.ndarray) -> None:
        """Decode the states `idx` of the window from `start` from their chunk's outputs (rows in `idx` order)
        into `out[start + i]`."""
        pos = 0
        for i in idx:
            n = len(encoded[i].rows)
            out[start + i] = self.decode(prepared, encoded[i], logits[pos:pos + n], act[pos:pos + n])
            pos += n

    def _encoded(self, windows: list[Sequence[Any]], prepared: Prepared) -> Iterator[list[EncodedState]]:
        """`encode_many` of each window in turn, the next one on a worker thread while the caller scores this one
        (the tokenizer releases the GIL; a wait for the device does too)."""
        if len(windows) == 1:
            yield self.encode_many(windows[0], prepared)
            return
        ahead = self._encode_pool.submit(self.encode_many, windows[0], prepared)
        for k in range(len(windows)):
            encoded = ahead.result()
            if k + 1 < len(windows):
                ahead = self._encode_pool.submit(self.encode_many, windows[k + 1], prepared)
            yield encoded

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Build every shape the backend will use before traffic, then publish what this process compiled
        to the shared cache (kinds that were not seeded from it); returns seconds spent, publishing included."""
        import time

        t = time.perf_counter()
        self.backend.warmup(max_batch_tokens)
        session = getattr(self, "cache", None)
        if session is not None and session.keys:
            for kind, status in session.publish().items():
                log.info("cache %s: %s", kind, status)
        return time.perf_counter() - t


# predict_batch on a packed backend, all states in one forward: from this many states, the first 1/LEAD_PARTS of
# them score alone while the rest are tokenized (on an H100, tokenizing 10 states of 512 tokens took 2.3 ms of a
# 27.8 ms request), when their rows hold LEAD_MIN_TOKENS tokens (fewer: a second forward's launch would cost more
# than the tokenizing it hides); each row is scored on its own tokens, so the answers are one forward's up to
# rounding (the kernels are picked by token count)
LEAD_MIN_STATES = 4
LEAD_PARTS = 5
LEAD_MIN_TOKENS = 2048

# the tokens a fast backend's default buffers hold (model/backends/fast/backend.py DEFAULT_MAX_BATCH_TOKENS)
FAST_ROW_TOKENS = 16384


def row_token_limit(bundle: Bundle, backend: Any) -> int:
    """The most tokens one row may hold on `backend` (an object, or its name where the scorer runs elsewhere): the
    eager and fast forwards read any row the encoder's positions cover (max_position_embeddings; the fast one
    within its buffers), as upstream's server does with a `max_len` above the checkpoint's; the compiled backends
    are built for the checkpoint's own `max_len`."""
    own = bundle.max_len
    name = backend if isinstance(backend, str) else backend.name
    if name == "fast" and not isinstance(backend, str):
        return max(own, int(backend.max_tokens_per_row))
    if name not in ("eager", "fast", "auto"):  # auto: fast on CUDA, else eager
        return int(getattr(backend, "max_tokens_per_row", own) or own)
    positions = bundle.encoder_dict.get("max_position_embeddings", 8192)
    if isinstance(positions, bool) or not isinstance(positions, int):
        return own
    return max(own, positions if name == "eager" else min(positions, FAST_ROW_TOKENS))


def resolve_device(device: Any = None) -> torch.device:
    """`device` as a torch.device; None means CUDA when available, else CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load(path: str, device: Any = None, backend: str = "auto", cache_dir: str | None = None,
         **options: Any) -> Engine:
    """Load a checkpoint directory and return a ready `Engine` (see `model.backends` for `backend`).

    For backends that compile (`compile`, `aot`, `fast`, and `auto` on CUDA) this first configures the
    process's compiler caches under `cache_dir` (argument, else $LAYA_FLEET_CACHE_DIR, else
    ~/.cache/laya-fleet): node-local compile dirs, seeded from the shared cache before anything compiles;
    `Engine.warmup()` publishes what was compiled. The session is `engine.cache` (None for eager).
    """
    from . import cache as _cache
    from .backends import ALIASES, BackendUnavailable, cache_code, make_backend

    bundle = open_bundle(path)
    dev = resolve_device(device)
    name = ALIASES.get(backend, backend)
    if name == "auto":
        name = "fast" if dev.type == "cuda" else "eager"
    session, ckpt = None, None
    if name in ("fast", "compile", "aot"):
        kinds = cache_code(name, dev)
        ckpt = checkpoint_hash(bundle.path) if kinds else None
        session = _cache.configure(cache_dir, ckpt, dev, kinds)
    model = None
    if name == "fast":  # weights only: skips transformers' modeling code (model/backends/fast/weights.py)
        from .backends.fast.weights import load_fast_model

        model = load_fast_model(bundle)
    if model is not None:
        try:
            be = make_backend("fast", model, bundle, dev, **options)
        except BackendUnavailable as e:
            if ALIASES.get(backend, backend) != "auto":
                raise
            warnings.warn("laya-fleet: fast backend unavailable (%s); using eager" % e, RuntimeWarning, stacklevel=2)
            model = load_model(bundle)
            be = make_backend("eager", model, bundle, dev)
    else:
        if name == "compile":
            from .backends.torch_encoder import load_native_model  # plain-torch ModernBERT: no transformers import

            model = load_native_model(bundle)
        if model is None and name != "aot":  # an AOTI package carries its weights: no model to build here
            model = load_model(bundle)
        be = make_backend(backend, model, bundle, dev, **options)
    log.info("loaded %s on %s with the %s backend", path, dev, be.name)
    engine = Engine(bundle, be)
    engine.cache = session
    if ckpt:
        engine._hash = ckpt
    return engine
