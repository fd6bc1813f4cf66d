"""laya-fleet's model package: Laya checkpoints, sequence building, the weightless codec, backends and the Engine."""

from .codec import Codec, Prepared
from .engine import Engine, load
from .questions import Question, validate_question, validate_questions

__all__ = ["Codec", "Engine", "Prepared", "Question", "load", "validate_question", "validate_questions"]
