"""Which served checkpoint answers a request: `CheckpointRouter.route`, deciding as upstream's `laya.router.Router`.

Precedence, as upstream's: an explicit `model` (a name, an alias, a published repo id; a Jev id, the bundle id or
any other name that is not a path means "choose for me"), then `task`, then (opt-in) question ids that are a
typed-decisions workflow, then `lang`, then `lang_guess`, then the state itself: no letters -> the default, a
non-Latin script -> multilingual, Latin-script English -> english, other Latin-script text -> multilingual, Latin
text whose language is not identified -> the default (serve_app/online/language.py reads the state).

A decision only ever names a served checkpoint. Naming an unserved one explicitly (`model`, `task`) is a 422;
when the state, `lang` or `lang_guess` points at one that is not served, the default answers and the reason
says so. Pure: no Ray, no weights; the language classifier loads on first use.
"""

from __future__ import annotations

import re
from typing import Any

from . import language
from .request_checks import HTTPError

BUNDLE_REPO = "convaiinnovations/laya"
# upstream's three checkpoint names and the ids they are published under (the bundle's subfolders)
BUILTIN = {"english": BUNDLE_REPO, "multilingual": BUNDLE_REPO + "/multilingual",
           "typed-decisions": BUNDLE_REPO + "/typed-decisions"}
# the standalone repositories a client may name; the bundle id itself means automatic routing
PUBLISHED_IDS = {"convaiinnovations/laya-multilingual": "multilingual",
                 "convaiinnovations/laya-typed-decisions": "typed-decisions"}
ALIASES = {
    "en": "english", "laya": "english", "default": "english",
    "multi": "multilingual", "ml": "multilingual", "laya-multilingual": "multilingual",
    "typed": "typed-decisions", "typed_decisions": "typed-decisions",
    "laya-typed-decisions": "typed-decisions", "decisions": "typed-decisions",
}
# question-id sets of the four typed-decisions workflows
WORKFLOWS = {
    "agent_trace_observability": {"action", "needs_review", "outcome", "risk", "urgency"},
    "customer_service": {"action", "category", "churn_risk", "needs_human", "urgency"},
    "invoice_processing": {"discrepancy_severity", "disposition", "duplicate", "matches_order", "urgency"},
    "security_incidents": {"credential_compromise", "disposition", "severity", "true_positive", "urgency"},
}
# language codes that name no language (POSIX locales, ISO 639 special codes): no evidence either way
_NO_LANGUAGE = {"c", "posix", "und", "zxx", "mul"}
_ENGLISH = {"en", "eng", "english"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# Latin text whose language is not identified reads as not English when this share of it is accented letters
ACCENTED_SHARE = 0.02


def canonical_name(name: Any) -> str:
    """`name` trimmed, lowercased and with an upstream alias resolved ("ML" -> "multilingual"); not checked."""
    key = str(name).strip().lower()
    return ALIASES.get(key, key)


def workflow_of(questions: Any) -> str | None:
    """The typed-decisions workflow whose question ids are exactly `questions`' ids, else None."""
    if not isinstance(questions, dict):
        return None
    ids = set(questions)
    return next((name for name, sig in WORKFLOWS.items() if ids == sig), None)


def english_code(code: Any) -> bool | None:
    """True for an English language code ("en", "en-US", "en_GB.UTF-8", "English"), False for another language,
    None for a code that names none ("", "C", "POSIX", "und", ...)."""
    if code is None:
        return None
    primary = str(code).strip().lower().split(".", 1)[0].replace("_", "-").split("-", 1)[0]
    if not primary or primary in _NO_LANGUAGE:
        return None
    return primary in _ENGLISH


def check_language_param(value: Any, key: str) -> str | None:
    """`lang` / `lang_guess` as a request may send it: a string or None, else HTTPError 422 (upstream's text)."""
    if value is not None and not isinstance(value, str):
        raise HTTPError(422, '%s must be a language code string such as "de", or null' % key)
    return value


def _names_a_source(text: str) -> bool:
    """Whether `text` is written as a path or a repository id (a slash, a backslash, a leading '.' or '~')."""
    return bool(text) and (text[0] in ".~" or "/" in text or "\\" in text)


class CheckpointRouter:
    """Routes requests between the served checkpoints `checkpoints` (name -> directory).

    Names are upstream's ("english", "multilingual", "typed-decisions", or an alias of one) or any other name of
    lowercase letters, digits, '.', '_' and '-'. `default` answers states that carry no language evidence; unset,
    it is "multilingual" when served (upstream's default), else the first name. `auto_task` routes question sets
    that are a typed-decisions workflow to "typed-decisions" when it is served (upstream's LAYA_AUTO_TASK).
    """

    def __init__(self, checkpoints: dict[str, str], default: str | None = None, *, auto_task: bool = False):
        if not checkpoints:
            raise ValueError("CheckpointRouter needs at least one checkpoint")
        self.checkpoints: dict[str, str] = {}
        for name, path in checkpoints.items():
            key = canonical_name(name)
            if not isinstance(name, str) or not _NAME.match(key) or key == "auto":
                raise ValueError("invalid checkpoint name %r: lowercase letters, digits, '.', '_' or '-', "
                                 "starting with a letter or digit, and not 'auto'" % (name,))
            if key in self.checkpoints:
                raise ValueError("checkpoint %r is named twice (%r)" % (key, name))
            self.checkpoints[key] = path
        self.names: list[str] = list(self.checkpoints)
        if default is None:
            default = "multilingual" if "multilingual" in self.checkpoints else self.names[0]
        self.default = canonical_name(default)
        if self.default not in self.checkpoints:
            raise ValueError("default checkpoint %r is not served; serve one of %s" % (default, self.names))
        self.auto_task = bool(auto_task)
        # what `model` / `task` may name: upstream's built-ins always, plus every served name
        self.known = sorted(set(BUILTIN) | set(self.names))

    def warm(self) -> None:
        """Load the language classifier now (a replica's start), so no request pays for it."""
        language.warm()

    def resolve(self, name: Any) -> str:
        """The served name `name` (or its alias) stands for; ValueError (upstream's "unknown model" text) else."""
        key = canonical_name(name)
        if key not in self.known:
            raise ValueError("unknown model %r; choose one of %s (or an alias: %s)"
                             % (name, self.known, sorted(ALIASES)))
        if key not in self.checkpoints:
            raise ValueError("model %r is not served here; this service serves %s" % (name, self.names))
        return key

    def requested_model(self, model: Any) -> str | None:
        """The served name a request's `model` pins, or None for automatic routing.

        Empty values, Jev ids ("jev-1"), the bundle id and any name that is not a checkpoint mean automatic
        routing, as upstream's server reads them; a path or an unpublished repo id, or a checkpoint that is not
        served, raises HTTPError 422."""
        if not model:
            return None
        text = str(model).strip()
        published = PUBLISHED_IDS.get(text.lower())
        if published is not None:
            model = published
        elif text.lower() == BUNDLE_REPO:
            return None
        key = canonical_name(model)
        if key in self.checkpoints:
            return key
        if key in self.known:
            raise HTTPError(422, "model %r is not served here; this service serves %s, or omit model to let "
                                 "the router choose" % (model, self.names))
        if _names_a_source(text):
            raise HTTPError(422, "unknown model %r; choose one of %s (or an alias: %s), or omit model to let "
                                 "the router choose" % (model, self.known, sorted(ALIASES)))
        return None

    def _task(self, task: Any) -> str:
        if str(task).lower().replace("-", "_") == "typed_decisions":
            task = "typed-decisions"
        try:
            return self.resolve(task)
        except ValueError as e:
            raise HTTPError(422, str(e)) from None

    def route(self, state: Any, questions: Any, *, model: Any = None, task: Any = None, lang: Any = None,
              lang_guess: Any = None) -> dict:
        """The decision for one request: {"model": served name, "repo": the published id of an upstream name
        (None for other names), "reason", "detection" (the state's script and language when they decided, else
        None), "workflow"}, upstream's keys in upstream's order. HTTPError 422 for a bad model, lang, lang_guess
        or task, checked in that order, as upstream's server does."""
        pinned = self.requested_model(model)
        lang = check_language_param(lang, "lang")
        lang_guess = check_language_param(lang_guess, "lang_guess")
        if pinned is not None:
            return self._decision(pinned, "explicit model=%r" % pinned)
        if task is not None:
            return self._decision(self._task(task), "explicit task=%r" % (task,))
        workflow = workflow_of(questions)
        if workflow and self.auto_task and "typed-decisions" in self.checkpoints:
            return self._decision("typed-decisions", "question ids match the %r typed-decisions workflow"
                                  % workflow, workflow=workflow)
        english = english_code(lang)
        if english is not None:
            return self._auto("english" if english else "multilingual", "explicit lang=%r" % (lang,), None, workflow)
        english = english_code(lang_guess)
        if english is not None:
            return self._auto("english" if english else "multilingual", "lang_guess: the caller identified this as "
                              "%s text" % ("English" if english else "non-English"), None, workflow)
        det = language.detect(state)
        return self._auto(*self._from_detection(det), det, workflow)

    def _from_detection(self, det: dict) -> tuple[str, str]:
        if det["script"] == "unknown":
            return self.default, "no letters detected in state; using default (%s)" % self.default
        if det["script"] != "latin":
            return "multilingual", ("non-Latin script (%s, %.0f%% of letters); the English checkpoint cannot read "
                                    "it" % (det["script"], 100 * det["non_latin_fraction"]))
        if det["mixed_segment"]:
            return "multilingual", ("Latin script, mostly English, but a line or field reads as %r (%r); the "
                                    "English checkpoint cannot read it" % (det["language"], det["mixed_segment"][:60]))
        if det["language"] == "en":
            return "english", "English Latin text"
        if det["language"]:
            return "multilingual", "Latin script but language looks like %r, not English" % det["language"]
        if not det["language_undecided"]:
            return "multilingual", ("Latin script, language not identified but it does not read as English; not "
                                    "safe for the English checkpoint")
        if det["diacritic_rate"] >= ACCENTED_SHARE:
            return "multilingual", ("Latin script, language not identified but %.0f%% non-English letters; not "
                                    "safe for the English checkpoint" % (100 * det["diacritic_rate"]))
        return self.default, ("Latin script, language not identified and no non-English letters; using default "
                              "(%s)" % self.default)

    def _auto(self, name: str, reason: str, detection: dict | None, workflow: str | None) -> dict:
        """A decision the request did not name: the default stands in for a checkpoint that is not served."""
        if name not in self.checkpoints:
            reason = "%s; %s is not served here, so the default (%s) answers" % (reason, name, self.default)
            name = self.default
        return self._decision(name, reason, detection, workflow)

    def _decision(self, name: str, reason: str, detection: dict | None = None, workflow: str | None = None) -> dict:
        return {"model": name, "repo": BUILTIN.get(name), "reason": reason, "detection": detection,
                "workflow": workflow}
