"""laya-fleet's model package: Laya checkpoints, sequence building, the weightless codec, backends and the Engine.

`Engine` and `load` import torch on first use, so a process that only tokenizes and decodes (`model.codec`, an
offline tokenize or decode worker) never imports it.
"""

from .codec import Codec, Prepared
from .questions import Question, validate_question, validate_questions

__all__ = ["Codec", "Engine", "Prepared", "Question", "load", "validate_question", "validate_questions"]


def __getattr__(name: str):
    if name in ("Engine", "load"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError("module 'model' has no attribute %r" % name)
