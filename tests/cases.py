"""Deterministic generated cases for parity tests: states and question sets of every shape."""

from __future__ import annotations

import random

WORDS = ("order refund late broken invoice payment password login error crash urgent angry happy thanks "
         "please help ticket price plan upgrade cancel shipping address product quality spam offer free "
         "click link security policy route model question answer server database network timeout").split()
UNICODE = ["café", "naïve", "Straße", "こんにちは", "谢谢", "привет", "مرحبا", "नमस्ते", "🙂", "ÆØÅ", "[MASK]"]


def text(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    for _ in range(rng.randint(0, 3)):
        words.insert(rng.randrange(len(words) + 1), rng.choice(UNICODE))
    return " ".join(words)


def state(rng: random.Random, kind: str, long: bool = False):
    n = rng.randint(400, 700) if long else rng.randint(3, 60)
    if kind == "text":
        return text(rng, n)
    if kind == "dict":
        meta = {"id": rng.randint(1, 999), "vip": rng.random() < .5}
        return {"subject": text(rng, 4), "body": text(rng, n), "meta": meta}
    return [{"role": rng.choice(["user", "assistant"]), "content": text(rng, max(2, n // 6))} for _ in range(6)]


def question(rng: random.Random, kind: str):
    ins = text(rng, rng.randint(3, 12))
    if kind == "choice-dict":
        n = rng.randint(2, 6)
        return {"type": "choice", "instructions": ins,
                "criteria": {"opt%d" % i: (text(rng, rng.randint(1, 8)) if rng.random() < .7 else None)
                             for i in range(n)}}
    if kind == "choice-list":
        return {"type": "choice", "instructions": ins, "criteria": ["label%d" % i for i in range(rng.randint(2, 5))]}
    if kind == "choice-1":
        return {"type": "choice", "instructions": ins, "criteria": {"only": "the single option"}}
    if kind == "choice-many":
        return {"type": "choice", "instructions": ins,
                "criteria": {"class_%d" % i: text(rng, rng.randint(1, 5)) for i in range(rng.randint(20, 30))}}
    if kind == "choice-dictcrit":
        return {"type": "choice", "instructions": {"task": ins, "lang": "en"},
                "criteria": {"a": {"desc": "first", "weight": 2}, "b": ["x", "y"], "c": 3}}
    if kind == "score":
        return {"type": "score", "instructions": ins, "criteria": [text(rng, 3) for _ in range(rng.randint(3, 6))]}
    if kind == "score-32":
        return {"type": "score", "instructions": ins, "criteria": ["level %d of 32" % i for i in range(32)]}
    if kind == "noul":
        return {"type": "noul", "instructions": ins}
    if kind == "noul-labels":
        return {"type": "noul", "instructions": ins, "labels": {"false": "NO", "true": "YES"},
                "criteria": {"true": text(rng, 4), "false": {"why": "not so"}}}
    if kind == "order":
        return {"type": "choice", "instructions": ins, "criteria": ["a", "b", "c", "d"], "option_order": [2, 0, 3, 1]}
    raise KeyError(kind)


QKINDS = ["choice-dict", "choice-list", "choice-1", "choice-many", "choice-dictcrit", "score", "score-32",
          "noul", "noul-labels", "order"]


def cases(n: int = 64, seed: int = 7):
    """`n` (states, questions) cases cycling through every state and question shape."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kinds = [QKINDS[i % len(QKINDS)]] + [rng.choice(QKINDS) for _ in range(rng.randint(0, 3))]
        qs = {"q%d_%s" % (j, k): question(rng, k) for j, k in enumerate(kinds)}
        n_states = rng.choice([1, 1, 2, 3, 5])
        skind = ("text", "dict", "list")[i % 3]
        states = [state(rng, skind if rng.random() < .7 else rng.choice(["text", "dict", "list"]),
                        long=(i % 5 == 0 and j == 0)) for j in range(n_states)]
        out.append((states, qs))
    return out
