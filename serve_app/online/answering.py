"""From a request body to routed, tokenized work and back to upstream's answer JSON (pure, no Ray).

`Answering` holds the served checkpoints and their router. `plan_one` / `plan_batch` check a body (400 / 413 /
422), read its controls (controls.py: every upstream body control validated, refused keys 422), route each
state to a checkpoint (routing.py: explicit `model`, `task`, `lang`, `lang_guess`, else the state's language)
and tokenize it with that checkpoint's codec; `finish` gives an answer its `routing`, `x_jev_confidence` and
the `min_confidence` gate, in upstream's key order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .controls import Controls, finish_answer, parse_controls, refuse_keys
from .request_checks import HTTPError, check_batch, check_request, object_body
from .routing import CheckpointRouter
from .schemas import Limits
from .served import ServedCheckpoint


@dataclass
class Group:
    """States of one request routed to one checkpoint: their indices in the request, the prepared questions
    (None: no questions) and each state's rows."""

    served: ServedCheckpoint
    index: list[int] = field(default_factory=list)
    prepared: Any = None
    encs: list = field(default_factory=list)


class Answering:
    """The request-side logic of the ingress over `served` ({served name: ServedCheckpoint}, the default first).
    `routing_default` answers states with no language evidence (None: upstream's rule, multilingual when served,
    else the default checkpoint); `auto_task` is upstream's LAYA_AUTO_TASK; `strict` its LAYA_JEV_STRICT."""

    def __init__(self, served: dict[str, ServedCheckpoint], limits: Limits, *, routing_default: str | None = None,
                 auto_task: bool = False, strict: bool = False):
        self.served, self.limits, self.strict = served, limits, strict
        self.router = CheckpointRouter({n: s.path for n, s in served.items()}, default=routing_default,
                                       auto_task=auto_task)

    # -- routing and answers ------------------------------------------------------------------
    def controls(self, body: dict, required: tuple[str, ...], batch: bool) -> tuple[dict, Controls]:
        """(body, its controls), refused in upstream's order: refused keys (422), a lone surrogate or a missing
        field (400, object_body), a bad `model`, then the other controls (422)."""
        refuse_keys(body, batch=batch)
        body = object_body(body, required)
        self.router.requested_model(body.get("model"))
        return body, parse_controls(body, batch=batch)

    def route(self, state: Any, questions: Any, controls: Controls) -> dict:
        """Upstream's `routing` (`model`, `repo`, `reason`, ...): the checkpoint that answers `state` (422 for a bad
        control)."""
        return self.router.route(state, questions, **controls.route_args())

    def finish(self, answer: dict, controls: Controls, routing: dict) -> dict:
        """The answer JSON upstream sends for `answer` (an error entry of a batch stays as it is); with `strict`
        (upstream's LAYA_JEV_STRICT), cut to the Jev contract."""
        return finish_answer(answer, controls, routing, strict=self.strict)

    # -- bodies -------------------------------------------------------------------------------
    def plan_one(self, body: Any) -> tuple:
        """(controls, routing, served checkpoint, prepared, the state's rows) for a `/v1/systemone` body."""
        if not isinstance(body, dict) or "questions" not in body:
            raise HTTPError(400, "request body must be an object with a 'questions' field")
        state, questions = body.get("state"), body["questions"]
        check_request(state, questions, self.limits)
        body, controls = self.controls(body, ("questions",), batch=False)
        routing = self.route(state, questions, controls)
        served = self.served[routing["model"]]
        return (controls, routing, served, *served.encode_one(state, questions, controls.budget()))

    def plan_batch(self, body: Any) -> tuple:
        """(states, controls, each state's routing, the groups to score) for a batch body."""
        if not isinstance(body, dict) or "questions" not in body or "states" not in body:
            raise HTTPError(400, "request body must be an object with 'states' and 'questions' fields")
        states, questions = body["states"], body["questions"]
        check_batch(states, questions, self.limits)
        body, controls = self.controls(body, ("states", "questions"), batch=True)
        budget = controls.budget()
        routes = [self.route(s, questions, controls) for s in states]
        groups: dict[str, Group] = {}
        for i, r in enumerate(routes):
            groups.setdefault(r["model"], Group(self.served[r["model"]])).index.append(i)
        for g in groups.values():
            g.prepared, g.encs = g.served.encode_many([states[i] for i in g.index], questions, budget)
        return states, controls, routes, list(groups.values())
