"""A checkpoint's tokenizer without importing transformers where the node-local cache already holds it.

The codec and the backends read little of transformers' `PreTrainedTokenizerFast`: the Rust tokenizer it builds
(special tokens added as it adds them) and the special tokens' strings and ids. Importing transformers was most
of the offline job's checks (1.12 s against 0.08 s without it on the CPU machine, bench/job_checks.py), paid by
every process that opens a checkpoint: the offline driver checking a job, each tokenize task and scorer actor,
each ingress replica. So the first process to open a tokenizer records what it
built (the Rust tokenizer's JSON and those ids) in the node-local cache, keyed by the tokenizer files' contents
and the transformers and tokenizers versions; later processes read that record with the `tokenizers` library
alone. What they get is what transformers built, by construction. Anything else (`len()`, calls, other
attributes) goes to a `PreTrainedTokenizerFast` built on first use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from importlib import metadata
from typing import Any

log = logging.getLogger(__name__)

CACHE_KIND = "tokenizers"   # the node-local cache directory (model.cache_dirs.local_dir) of the records
IDS = ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id")
TOKENS = ("cls_token", "sep_token", "pad_token", "mask_token", "unk_token")
RECORD_VERSION = 1


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def record_key(tok_file: str, special: dict[str, str]) -> str:
    """The cache key of a tokenizer: its tokenizer.json and special tokens, and the versions that build it."""
    h = hashlib.sha256()
    with open(tok_file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    h.update(json.dumps({"special": special, "transformers": _version("transformers"),
                         "tokenizers": _version("tokenizers"), "v": RECORD_VERSION}, sort_keys=True).encode())
    return h.hexdigest()[:32]


class Tokenizer:
    """What the codec and backends read of a checkpoint's tokenizer (`backend_tokenizer`, the special tokens'
    strings and `*_token_id`s), from a cache record or from the `PreTrainedTokenizerFast` it wraps; every other
    attribute, `len()` and calls are that wrapper's, built on first use."""

    def __init__(self, tok_file: str, special: dict[str, str], record: dict | None = None, hf: Any = None):
        self._tok_file, self._special, self._hf = tok_file, dict(special), hf
        if record is None:
            record = _record(self.hf)
        from tokenizers import Tokenizer as RustTokenizer

        self.backend_tokenizer = RustTokenizer.from_str(record["backend"])
        for k in TOKENS:
            setattr(self, k, record["tokens"].get(k))
        for k in IDS:
            setattr(self, k, record["ids"][k])
        self.record = record

    @property
    def hf(self) -> Any:
        """transformers' `PreTrainedTokenizerFast` over the same files (imports transformers on first use)."""
        if self._hf is None:
            self._hf = build_hf(self._tok_file, self._special)
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # unpickling and copy look these up before __init__ has run
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.hf(*args, **kw)

    def __getstate__(self) -> dict:
        return {"tok_file": self._tok_file, "special": self._special, "record": self.record}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tok_file"], state["special"], state["record"])


def build_hf(tok_file: str, special: dict[str, str]) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=tok_file, **special)


def _record(hf: Any) -> dict:
    return {"v": RECORD_VERSION, "backend": hf.backend_tokenizer.to_str(),
            "tokens": {k: getattr(hf, k) for k in TOKENS}, "ids": {k: getattr(hf, k) for k in IDS}}


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    ok = (isinstance(rec, dict) and rec.get("v") == RECORD_VERSION and isinstance(rec.get("backend"), str)
          and isinstance(rec.get("tokens"), dict) and isinstance(rec.get("ids"), dict)
          and all(k in rec["ids"] for k in IDS))
    return rec if ok else None


def _write(path: str, rec: dict) -> None:
    """Best effort (a read-only or full cache directory only costs the next process the import)."""
    tmp = "%s.%d.%d.tmp" % (path, os.getpid(), threading.get_ident())  # one writer per file, threads included
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(rec, fh)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("could not record the tokenizer in %s: %s", path, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def load(tok_file: str, special: dict[str, str], cache: bool = True) -> Tokenizer:
    """The tokenizer of `tok_file` with `special` tokens: from the node-local cache's record when there is one
    (no transformers import), else built by transformers and recorded there."""
    path = None
    if cache:
        from .cache_dirs import local_dir

        try:
            path = os.path.join(local_dir(CACHE_KIND), record_key(tok_file, special) + ".json")
        except OSError:
            path = None
    rec = _read(path) if path else None
    if rec is not None:
        return Tokenizer(tok_file, special, rec)
    hf = build_hf(tok_file, special)
    tok = Tokenizer(tok_file, special, hf=hf)
    if path:
        _write(path, tok.record)
    return tok
