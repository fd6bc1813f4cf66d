"""The HTTP API's request limits and its typed OpenAPI: pydantic models of every route's body and answer.

The handlers (ingress.py) read the raw request and keep their own checks, statuses and error texts;
these models only describe them in `/openapi.json` and `/docs` (attached through `openapi_extra` and
`responses=`, so FastAPI validates nothing itself).
"""

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema


class Limits(BaseModel):
    """Request limits; defaults are upstream `laya-serve`'s, except the text limits, which upstream lacks."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    max_questions: int = Field(64, ge=1)
    max_state_chars: int = Field(50_000, ge=1)
    max_choice_options: int = Field(100, ge=1)
    max_score_levels: int = Field(32, ge=1)
    max_total_options: int = Field(512, ge=1)
    max_batch_states: int = Field(64, ge=1)
    max_instruction_chars: int = Field(8192, ge=1, description="characters of one question's instructions "
                                                              "(JSON length when not a string)")
    max_criterion_chars: int = Field(2048, ge=1, description="characters of one criterion text: a label, a "
                                                            "description, a score level, a noul label")
    body_read_timeout_s: float = Field(10.0, gt=0)
    scorer_timeout_s: float = Field(60.0, gt=0, description="give up on one scorer call after this long (504)")
    scorer_retries: int = Field(3, ge=0, description="retries of a scorer call whose replica died")


_LIMITS = Limits()
_EXAMPLE = {"state": "Hi, my order #1234 arrived broken and I want my money back today.",
            "questions": {"intent": {"type": "choice", "instructions": "What does the customer want?",
                                     "criteria": {"refund": "money back", "replacement": "a new item"}},
                          "angry": {"type": "noul", "instructions": "Is the customer angry?"}}}
_BATCH_EXAMPLE = {"states": [_EXAMPLE["state"], {"subject": "invoice", "body": "Where is my invoice?"}],
                  "questions": _EXAMPLE["questions"]}
_INSTRUCTIONS_DOC = ("what the model should answer, about the state; at most %d characters (413); an object or "
                     "array is accepted and read as its JSON" % _LIMITS.max_instruction_chars)
_ORDER_DOC = "a permutation of range(number of options): slot s of the sequence shows option option_order[s]"


class ChoiceQuestion(BaseModel):
    """Pick one of the criteria."""

    model_config = ConfigDict(extra="allow")

    type: Literal["choice"]
    instructions: str = Field(max_length=_LIMITS.max_instruction_chars, description=_INSTRUCTIONS_DOC)
    criteria: (Annotated[dict[str, Any], Field(max_length=_LIMITS.max_choice_options)]
               | Annotated[list[Any], Field(max_length=_LIMITS.max_choice_options)]) = Field(
        description="{label: description} or [label, ...]; at most %d options (413), %d across all questions"
                    % (_LIMITS.max_choice_options, _LIMITS.max_total_options))
    option_order: list[int] | None = Field(None, description=_ORDER_DOC)


class ScoreQuestion(BaseModel):
    """An expected level over ordered criteria (0 = the first)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["score"]
    instructions: str = Field(max_length=_LIMITS.max_instruction_chars, description=_INSTRUCTIONS_DOC)
    criteria: list[Any] = Field(max_length=_LIMITS.max_score_levels,
                                description="level texts from lowest to highest; at most %d levels (413)"
                                            % _LIMITS.max_score_levels)
    option_order: list[int] | None = Field(None, description=_ORDER_DOC)


class NoulQuestion(BaseModel):
    """Yes or no: the probability that the statement holds."""

    model_config = ConfigDict(extra="allow")

    type: Literal["noul"]
    instructions: str = Field(max_length=_LIMITS.max_instruction_chars, description=_INSTRUCTIONS_DOC)
    criteria: dict[str, Any] | None = Field(None, description="optional {'false': ..., 'true': ...} descriptions")
    labels: dict[str, str] | None = Field(None, description="{'false': ..., 'true': ...}: how the sides are worded")
    option_order: list[int] | None = Field(None, description=_ORDER_DOC)


Question = Annotated[ChoiceQuestion | ScoreQuestion | NoulQuestion, Field(discriminator="type")]
State = Annotated[
    Annotated[str, Field(max_length=_LIMITS.max_state_chars)] | dict[str, Any] | list[Any],
    Field(description="the text the questions are about; an object or array is read as its JSON, at most %d "
                      "characters either way (413)" % _LIMITS.max_state_chars)]
_QUESTIONS_DOC = ("question id -> question; at most %d questions (413); an invalid question is 422 naming it"
                  % _LIMITS.max_questions)
_MODEL_DOC = ("the checkpoint to answer: a served name or alias (english, multilingual, typed-decisions, ...) or a "
              "published repo id; a Jev id such as jev-1, the bundle id convaiinnovations/laya or null route "
              "automatically; a path or an unpublished repo id is 422")
_MAX_LEN_DOC = ("token budget per row (default: the checkpoint's max_len; at most 8192, the server's budget, 422 "
                "beyond); above the checkpoint's own, an eager scorer reads longer rows as upstream does")
_HEAD_LEN_DOC = "token budget of a question's head (default: the checkpoint's head_max_len; at most 8192, 422 beyond)"
_TASK_DOC = "a typed-decisions workflow name: routes to the typed-decisions checkpoint; an unknown task is 422"
_LANG_DOC = "the state's language code (e.g. \"de\"): decides the checkpoint; not a string is 422"
_LANG_GUESS_DOC = "a soft language hint, checked after lang and before detection; not a string is 422"
_MIN_CONF_DOC = ("abstention gate: a number in [0, 1], or an object of option-count bucket -> number (\"choice:2\", "
                 "\"choice:3-5\", \"choice:6-10\", \"choice:11+\", the same for score and noul, and \"default\"); "
                 "each answer gets abstention, abstention_threshold and, below it, low_confidence; 422 otherwise")
Threshold = Annotated[float, Field(ge=0, le=1)]


class _Controls(BaseModel):
    """The body controls both routes take (upstream laya-serve's `BODY_CONTROLS`)."""

    model: str | None = Field(None, description=_MODEL_DOC)
    max_len: int | None = Field(None, ge=1, le=8192, description=_MAX_LEN_DOC)
    head_max_len: int | None = Field(None, ge=1, le=8192, description=_HEAD_LEN_DOC)
    task: str | None = Field(None, description=_TASK_DOC)
    lang: str | None = Field(None, description=_LANG_DOC)
    lang_guess: str | None = Field(None, description=_LANG_GUESS_DOC)
    min_confidence: Threshold | dict[str, Threshold] | None = Field(None, description=_MIN_CONF_DOC)


class SystemOneRequest(_Controls):
    """`POST /v1/systemone`: questions about one state (upstream Laya / Jev wire format). The hook keys (hooks,
    on_predict_start, on_predict_end, hooks_raise, hooks_timeout) run server-side code: refused (422) unless null."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [_EXAMPLE]})

    state: State
    questions: dict[str, Question] = Field(max_length=_LIMITS.max_questions, description=_QUESTIONS_DOC)


class BatchRequest(_Controls):
    """`POST /v1/systemone/batch`: one question set about many states, one set of controls for all of them. The
    hook keys and `diagnostics` (an in-process out-parameter) are refused (422) unless null."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [_BATCH_EXAMPLE]})

    states: list[State] = Field(min_length=1, max_length=_LIMITS.max_batch_states,
                                description="1..%d states (413 beyond), answered in order" % _LIMITS.max_batch_states)
    questions: dict[str, Question] = Field(max_length=_LIMITS.max_questions, description=_QUESTIONS_DOC)
    batch_size: int | None = Field(None, ge=1, description="upstream's states per forward pass: checked (a positive "
                                   "integer, else 422) and accepted; answers do not depend on it here (the scorer "
                                   "batches by tokens)")
    sort_by_length: bool | None = Field(None, description="upstream's length sorting: checked (a boolean, else 422) "
                                        "and accepted; answers keep input order either way")


class Action(BaseModel):
    act_probability: float = Field(description="P(acting on this answer is right) from the action head")


class _Answer(BaseModel):
    confidence: float = Field(description="1 - normalised entropy of the probabilities (noul: max(p, 1 - p))")
    answer_confidence: float = Field(description="the probability of the answer given")
    action: Action
    low_confidence: bool | None = Field(None, description="true when min_confidence was set and the answer "
                                        "confidence fell below its threshold (absent otherwise)")
    abstention: Literal["passed", "abstained", "unevaluated"] | None = Field(
        None, description="the gate's verdict, on every answer of a request with min_confidence")
    abstention_threshold: float | None = Field(None, description="the threshold this answer's bucket was gated at")


class _JevConfidence(BaseModel):
    x_jev_confidence: float | None = Field(None, description="the confidence Jev's formula gives these probabilities")


class ChoiceAnswer(_Answer, _JevConfidence):
    type: Literal["choice"]
    choice: Any = Field(description="the label with the highest probability")
    probabilities: dict[str, float] = Field(description="label -> probability, rounded to 4 places")


class ScoreAnswer(_Answer, _JevConfidence):
    type: Literal["score"]
    score: float = Field(description="the expected level: sum of level x probability")
    legend: dict[str, str] = Field(description="level -> its text")
    probabilities: dict[str, float] = Field(description="level -> probability")


class NoulAnswer(_Answer):
    type: Literal["noul"]
    noul: float = Field(description="P(true)")


class OptionsCollapsed(BaseModel):
    total: int
    distinct: int
    tokens_per_option: int


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = Field(description="always 0 (no generation)")
    state_tokens: int | None = Field(None, description="tokens of the state (absent without questions)")
    state_tokens_dropped: int | None = Field(None, description="state tokens cut to fit max_len (largest over rows)")
    truncated: bool | None = None
    truncated_questions: list[str] | None = Field(None, description="ids of the questions whose rows cut the state")
    options: dict[str, OptionsCollapsed] | None = Field(
        None, description="questions whose options share a rendering (only when some do)")


class Routing(BaseModel):
    """Which checkpoint answered, and why (upstream's router decision)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="the served checkpoint name", examples=["english"])
    repo: str | None = Field(description="its upstream repository id, when it has one")
    reason: str = Field(examples=["explicit model='english'"])


class SystemOneResponse(BaseModel):
    """The upstream answer JSON (`Engine.predict`, then `routing` and `x_jev_confidence`)."""

    model: str = Field(examples=["laya-rl-agent"])
    answers: dict[str, Annotated[ChoiceAnswer | ScoreAnswer | NoulAnswer, Field(discriminator="type")]]
    usage: Usage
    routing: Routing | None = None


class StateError(BaseModel):
    """A batch state that could not be scored (the others are answered)."""

    model: str = Field(examples=["laya-rl-agent"])
    error: str = Field(examples=["inference failed"])


class TotalUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class BatchResponse(BaseModel):
    """Upstream's batch answer: exactly `results` and `total_usage`."""

    results: list[SystemOneResponse | StateError] = Field(
        description="one answer JSON per state, in order; a state the scorer failed on is a StateError")
    total_usage: TotalUsage


class ErrorResponse(BaseModel):
    """Every error answer: a fixed, client-safe text (question errors name the question)."""

    detail: str = Field(examples=["invalid or missing bearer token"])


class HealthResponse(BaseModel):
    """Upstream laya-serve's `/health`: liveness for anyone; the other fields only for an authorized caller (or with
    no key set), absent otherwise."""

    status: Literal["ok"]
    loaded: list[str] = Field(None, description="served names of the checkpoints loaded (a running replica)")
    revisions: dict[str, str | None] = Field(None, description="served name -> checkpoint revision")
    device: str = Field(None, description="the device the checkpoints run on")
    device_is_preference: bool = Field(None, description="whether `device` was asked for, not detected")
    checkpoint_devices: dict[str, str] = Field(None, description="served name -> its device")
    cpu_fallbacks: dict[str, dict] = Field(None, description="served name -> why it fell back to CPU")


class ReadyResponse(BaseModel):
    ready: bool
    busy: bool | None = Field(None, description="true when every scorer replica is saturated")
    budget: int | None = Field(None, description="the answering scorer replica's token budget")


class GcCounters(BaseModel):
    """Python's collections in one replica process since it started serving (serve_app/online/gc_pauses.py)."""

    collections: list[int] = Field(description="collections of generations 0, 1, 2")
    seconds: list[float] = Field(description="seconds they took, per generation (the GIL held throughout)")
    max_ms: list[float] = Field(description="the longest of each generation, ms")
    frozen: int = Field(description="objects in the permanent generation (start-up's: Ray Serve freezes them)")
    pid: int = Field(description="the replica process these counters describe")


class IngressCounters(BaseModel):
    scorer_calls: int
    requests: int = Field(description="requests those scorer calls carried (coalescing)")
    waiting: int
    inflight: int
    ray_serve: dict[str, bool] = Field(description="how Ray Serve runs this replica's request path")
    gc: GcCounters


class StatsResponse(BaseModel):
    """One scorer replica's batching counters plus this ingress replica's scorer calls."""

    model_config = ConfigDict(extra="allow")

    requests: int
    rows: int
    batches: int
    fallback_batches: int
    errors: int
    batch_sizes: dict[str, int] = Field(description="requests per batch -> batches")
    max_batch_requests: int
    mean_queue_wait_ms: float
    forward_s: float
    engine_s: float
    budget: int
    oom_retries: int
    gc: GcCounters = Field(description="the scorer replica's process (the ingress's own in the fused topology)")
    ingress: IngressCounters


class CheckpointInfo(BaseModel):
    """One served checkpoint; a checkpoint scaled to zero (no replica running) has only `served_as` and `loaded`
    (the other fields are then absent)."""

    served_as: str = Field(description="the name requests route to", examples=["english"])
    loaded: bool | None = Field(description="whether a replica of its scorer runs now (None: unknown)")
    name: str = Field(None, description="the checkpoint directory's name")
    hash: str = Field(None, description="content hash of config, weights and tokenizer (model.bundle.checkpoint_hash)")
    model: str = Field(None, description="the model name answers carry")
    backend: str = Field(None, description="eager | compile | aot | fast")
    dtype: str = Field(None, description="the precision the forward computes in: bfloat16, float16, float32, or "
                       "fp8-e4m3 (the encoder's GEMMs in e4m3, the rest bfloat16)", examples=["bfloat16", "float32"])
    device: str = Field(None, description="the device its scorer runs on")
    max_len: int = Field(None, description="tokens per row")
    head_max_len: int = Field(None, description="tokens per question head")


class BatchingInfo(BaseModel):
    max_batch_tokens: int | None = Field(description="the configured token budget; None = the scorer's default")
    max_batch_rows: int | None
    batch_wait_timeout_s: float
    budget: int = Field(description="the token budget the answering scorer replica uses now")


class InfoResponse(BaseModel):
    """What this service runs (in the manner of text-embeddings-inference's `/info`)."""

    topology: Literal["split", "fused"]
    checkpoints: list[CheckpointInfo]
    limits: Limits
    batching: BatchingInfo
    versions: dict[str, str | None] = Field(description="distribution -> version; None when not installed",
                                            examples=[{"laya-fleet": "0.1.0", "torch": "2.13.0", "ray": "2.60.0",
                                                       "tilelang": None}])


# the request models' schemas, named as OpenAPI components (`_openapi` adds them to the document)
_REF = "#/components/schemas/{model}"
_REQUEST_SCHEMAS = models_json_schema([(SystemOneRequest, "validation"), (BatchRequest, "validation")],
                                      ref_template=_REF)[1]["$defs"]


def _request_doc(model: type[BaseModel], example: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}, "example": example}}}}


def error_docs(*statuses: int) -> dict:
    """OpenAPI `responses=` entries of these error statuses ({"detail": ...} bodies)."""
    what = {400: "malformed JSON or missing fields", 401: "missing or wrong bearer key",
            408: "body not received in time", 413: "over a size limit",
            415: "Content-Type is not application/json (or +json) with UTF-8",
            422: "a question or budget fails validation",
            500: "internal error", 503: "overloaded or no scorer: retry after Retry-After seconds",
            504: "a scorer call timed out"}
    return {s: {"model": ErrorResponse, "description": what[s]} for s in statuses}


BODY_DOC = _request_doc(SystemOneRequest, _EXAMPLE)
BATCH_DOC = _request_doc(BatchRequest, _BATCH_EXAMPLE)
SCORE_ERRORS = error_docs(400, 401, 408, 413, 415, 422, 500, 503, 504)


class DocumentedApp(FastAPI):
    """FastAPI whose OpenAPI document also holds the request models' schemas (the routes' requestBody refers to
    them; the handlers read the raw body, so FastAPI itself never sees these models)."""

    def openapi(self) -> dict:
        if self.openapi_schema is None:
            spec = super().openapi()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(_REQUEST_SCHEMAS)
        return self.openapi_schema
