"""laya-fleet's model package: Laya checkpoints, sequence building, backends and the Engine API."""

from .engine import Engine, Prepared, load
from .questions import Question, validate_question, validate_questions

__all__ = ["Engine", "Prepared", "Question", "load", "validate_question", "validate_questions"]
