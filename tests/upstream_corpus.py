"""The requests the differential test sends to upstream's `laya-serve` and to laya-fleet's app alike.

Each `Case` is one HTTP request (good ones and every kind of bad one) plus how its two answers are compared:
the status always; the error text where upstream's is fixed (`text="exact"`), or up to where upstream formats
its own registry into it (`text="prefix"`); answers, usage and `routing.model` on a 200. `owner` names the part
of laya-fleet a mismatch points at: ROUTING (model/task/lang routing and their 422s), CONTROLS (the other body
controls, answer fields, min_confidence) or SERVING (HTTP layer: auth, /health, headers, status codes).
`differs` marks a request where laya-fleet answers differently on purpose, with the reason: laya-fleet's status
(`ours`) or checkpoint (`routed`) is checked instead, and the phrase (`documented`) that the section of the doc
listing its deliberate differences (docs/serving.md, or docs/routing.md for routing) must contain.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any

ROUTING, CONTROLS, SERVING = "ROUTING", "CONTROLS", "SERVING"
# ASCII on purpose: upstream re-encodes as UTF-8 the header Starlette decoded as latin-1, so a non-ASCII key sent
# as UTF-8 bytes never matches there; that quirk is not what these tests compare.
API_KEY = "upstream-diff-key-0123456789"
ONE, BATCH = "/v1/systemone", "/v1/systemone/batch"

QS = {
    "intent": {"type": "choice", "instructions": "What does the customer want?",
               "criteria": {"refund": "money back", "replace": "a new item", "track": "where it is"}},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["low", "medium", "high"]},
    "angry": {"type": "noul", "instructions": "The customer is angry.",
              "labels": {"false": "calm", "true": "angry"}},
}
Q1 = {"intent": QS["intent"]}

STATES = {  # one per script, plus Latin-script languages with and without enough evidence
    "en": "I ordered a laptop last week and it still has not arrived, I want my money back please",
    "ru": "Я заказал ноутбук на прошлой неделе, и он до сих пор не пришёл, верните деньги",
    "uk": "Я замовив ноутбук минулого тижня, і він досі не прийшов, поверніть гроші",
    "ar": "طلبت جهاز كمبيوتر محمول الأسبوع الماضي ولم يصل بعد، أريد استرداد أموالي",
    "zh": "我上周订购了一台笔记本电脑，到现在还没到，我要退款",
    "ja": "先週ノートパソコンを注文しましたが、まだ届いていません。返金してください",
    "ko": "지난주에 노트북을 주문했는데 아직 도착하지 않았어요. 환불해 주세요",
    "hi": "मैंने पिछले हफ्ते एक लैपटॉप ऑर्डर किया था और वह अभी तक नहीं आया, मुझे पैसे वापस चाहिए",
    "el": "Παρήγγειλα ένα λάπτοπ την περασμένη εβδομάδα και δεν έχει φτάσει ακόμα",
    "he": "הזמנתי מחשב נייד בשבוע שעבר והוא עדיין לא הגיע, אני רוצה החזר",
    "th": "ฉันสั่งแล็ปท็อปเมื่อสัปดาห์ที่แล้วและยังไม่ได้รับเลย ขอเงินคืน",
    "de": "Ich habe letzte Woche einen Laptop bestellt und er ist immer noch nicht angekommen, ich möchte mein Geld",
    "fr": "J'ai commandé un ordinateur portable la semaine dernière et il n'est toujours pas arrivé, je veux",
    "es": "Pedí una computadora portátil la semana pasada y todavía no ha llegado, quiero que me devuelvan",
    "it": "Ho ordinato un portatile la settimana scorsa e non è ancora arrivato, voglio indietro i miei soldi",
    "nl": "Ik heb vorige week een laptop besteld en hij is nog steeds niet aangekomen, ik wil mijn geld terug",
    "pl": "Zamówiłem laptopa w zeszłym tygodniu i nadal nie dotarł, chcę zwrotu pieniędzy",
    "tr": "Geçen hafta bir dizüstü bilgisayar sipariş ettim ve hâlâ gelmedi, paramı geri istiyorum",
    "vi": "Tôi đã đặt một máy tính xách tay tuần trước và nó vẫn chưa đến, tôi muốn được hoàn tiền",
    "id": "Saya memesan laptop minggu lalu dan sampai sekarang belum datang, saya mau uang saya kembali",
    "ru_en_mixed": "Order 4411 never arrived. Заказ так и не пришёл, верните деньги пожалуйста",
    "pt_short": "Quero cancelar",
    "digits": "12345 67890 !!! ###",
    "en_de_mixed": "Order 4411: the laptop never arrived.\nIch möchte mein Geld zurück, und zwar sofort bitte.",
}
EN = STATES["en"]
REFUSALS = ("hooks", "on_predict_start", "on_predict_end", "hooks_raise", "hooks_timeout")
SERVING_DOC = ("docs/serving.md", "## Where laya-fleet differs from upstream, on purpose")
ROUTING_DOC = ("docs/routing.md", "## Agreement with upstream")
LATIN_ID = ("Latin-script language identification: a language identifier reads the state where upstream reads "
            "English stopwords")
OWN_LIMITS = ("laya-fleet bounds one instruction and one criterion text (limits.max_instruction_chars 8192, "
              "max_criterion_chars 2048); upstream bounds only the state, the counts and the body")
NOT_SERVED = ("no typed-decisions checkpoint is configured: upstream falls back to the Hub for a built-in name "
              "(offline here: 500), laya-fleet refuses a checkpoint it does not serve")


@dataclass
class Case:
    """One request and how to compare the two servers' answers to it."""

    name: str
    owner: str
    body: Any = None  # JSON value, or bytes sent as they are
    path: str = ONE
    method: str = "POST"
    auth: str = "key"  # key | none | wrong | scheme (the key under another scheme)
    headers: dict = field(default_factory=dict)  # a None value removes that header
    text: str = "exact"  # exact | prefix: how an error's detail is compared
    differs: str | None = None  # why laya-fleet answers this differently on purpose
    ours: tuple = ()  # with `differs`: the statuses laya-fleet answers
    routed: str | None = None  # with `differs`: the checkpoint laya-fleet routes to, where upstream routes elsewhere
    documented: str = ""  # with `differs`: the phrase of the `doc` section that lists the difference
    doc: tuple = SERVING_DOC  # (file, section heading) where laya-fleet lists its deliberate differences

    def content(self) -> bytes | None:
        """The request body as sent."""
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode("utf-8")


def one(state: Any = EN, questions: Any = None, **controls: Any) -> dict:
    """A /v1/systemone body."""
    return {"state": state, "questions": QS if questions is None else questions, **controls}


def batch(states: Any = None, questions: Any = None, **controls: Any) -> dict:
    """A /v1/systemone/batch body."""
    return {"states": [EN, STATES["ru"], "Where is my parcel?"] if states is None else states,
            "questions": QS if questions is None else questions, **controls}


def _good() -> list[Case]:
    cases = [Case("state %s" % k, ROUTING, one(v)) for k, v in STATES.items()]
    return cases + [
        Case("state dict", ROUTING, one({"customer": "Ann", "message": EN})),
        Case("state list", ROUTING, one(["order 4411", EN])),
        Case("state nested non-latin dict", ROUTING, one({"message": STATES["ru"], "id": 7})),
        Case("choice criteria list", CONTROLS, one(EN, {"q": {"type": "choice", "instructions": "pick",
                                                              "criteria": ["refund", "replace"]}})),
        Case("choice criteria null descriptions", CONTROLS,
             one(EN, {"q": {"type": "choice", "instructions": "pick", "criteria": {"a": None, "b": ""}}})),
        Case("noul with criteria", CONTROLS,
             one(EN, {"q": {"type": "noul", "instructions": "late?",
                            "criteria": {"true": "it is late", "false": "on time"}}})),
        Case("instructions as object", CONTROLS,
             one(EN, {"q": {"type": "choice", "instructions": {"ask": "pick"}, "criteria": ["x", "y"]}})),
        Case("empty questions", CONTROLS, one(EN, {})),
        Case("empty string state", CONTROLS, one("")),
        Case("text/plain content type", CONTROLS, one(), headers={"Content-Type": "text/plain"}, ours=(415,),
             differs="a body not declared JSON is 415: browsers send text/plain cross-origin without a preflight",
             documented="415 for a body not declared JSON"),
        Case("unknown body key ignored", CONTROLS, one(extra_field=1)),
        Case("query string ignored", SERVING, one(), path=ONE + "?debug=1"),
        Case("state near the char limit", CONTROLS, one("word " * 9999)),
        Case("state deeply nested", CONTROLS, one(json.loads("[" * 60 + json.dumps(EN) + "]" * 60))),
        Case("Dutch read as English upstream", ROUTING, one("Waar is mijn bestelling? Die zou vorige week aankomen."),
             differs=LATIN_ID, ours=(200,), routed="multilingual", documented="Waar is mijn", doc=ROUTING_DOC),
        Case("three English words", ROUTING, one("Please help me"), differs=LATIN_ID, ours=(200,),
             routed="english", documented="Please help me", doc=ROUTING_DOC),
        Case("three undecided words", ROUTING, one("Reset my password")),
        Case("state NFD accents", ROUTING,
             one(unicodedata.normalize("NFD", "Je voudrais être remboursé, la commande n'est jamais arrivée"))),
        Case("state zero-width characters", ROUTING, one("I\u200bwant\u200ba\u200brefund for order 4411 please")),
        Case("choice with one option", CONTROLS, one(EN, {"q": {"type": "choice", "instructions": "x",
                                                                "criteria": ["only"]}})),
        Case("choice option_order", CONTROLS, one(EN, {"q": dict(QS["intent"], option_order=[2, 0, 1])})),
        Case("choice option_order labels", CONTROLS, one(EN, {"q": dict(QS["intent"], option_order=["track"])})),
        Case("choice option_order repeats", CONTROLS, one(EN, {"q": dict(QS["intent"], option_order=[0, 0, 1])})),
        Case("noul labels equal", CONTROLS, one(EN, {"q": {"type": "noul", "instructions": "x",
                                                           "labels": {"false": "same", "true": "same"}}})),
        Case("choice criteria empty", CONTROLS, one(EN, {"q": {"type": "choice", "instructions": "x",
                                                               "criteria": []}})),
        Case("score criteria empty", CONTROLS, one(EN, {"q": {"type": "score", "instructions": "x",
                                                              "criteria": []}})),
        Case("empty question id and instructions", CONTROLS, one(EN, {"": {"type": "noul", "instructions": ""}})),
        Case("duplicate body keys, last wins", CONTROLS,
             b'{"state": "ignored", "state": "I want a refund", "questions": {"q": {"type": "noul", '
             b'"instructions": "refund?"}}}'),
        Case("body with a UTF-8 BOM", CONTROLS, b"\xef\xbb\xbf" + json.dumps(one()).encode()),
        Case("body in UTF-16", CONTROLS, json.dumps(one()).encode("utf-16")),
        Case("no Content-Type", CONTROLS, one(), headers={"Content-Type": None}, ours=(415,),
             differs="a body not declared JSON is 415 (no preflight for it cross-origin)",
             documented="415 for a body not declared JSON"),
        Case("charset latin-1", CONTROLS, one(), headers={"Content-Type": "application/json; charset=latin-1"},
             ours=(415,), differs="a JSON body is UTF-8; a declared other charset is 415", documented="charset"),
        Case("state number past a double", CONTROLS,
             b'{"state": {"n": 1e400}, "questions": {"q": {"type": "noul", "instructions": "x"}}}', ours=(400,),
             differs="strict JSON: a number past a double's range is 400, where upstream's json.loads reads inf",
             documented="past a double's range"),
        Case("typed-decisions workflow ids, auto task off", ROUTING,
             one(STATES["ru"], {k: QS["angry"] for k in ("action", "category", "churn_risk", "needs_human",
                                                          "urgency")})),
    ]


def _models() -> list[Case]:
    named = ["english", "multilingual", "ENGLISH", " multilingual ", "en", "laya", "default", "ml", "multi",
             "laya-multilingual", "convaiinnovations/laya-multilingual", "CONVAIINNOVATIONS/LAYA-MULTILINGUAL"]
    auto = ["convaiinnovations/laya", "jev-1", "auto", "gpt-4o", "", None]
    bad = ["./ckpt", "~/ckpt", "/srv/models/english", "someone/fine-tune", "C:\\models\\x", "../english",
           "convaiinnovations/laya-english"]
    cases = [Case("model %r" % m, ROUTING, one(STATES["ru"] if "english" in m.lower() or m in ("en", "laya",
                                                                                                 "default")
                                                else EN, model=m)) for m in named]
    cases += [Case("model %r auto" % (m,), ROUTING, one(STATES["ru"], model=m)) for m in auto]
    cases += [Case("model %r refused" % m, ROUTING, one(model=m), text="prefix") for m in bad]
    cases += [Case("model %s" % json.dumps(v), ROUTING, one(model=v)) for v in (7, True, ["english"], {"a": 1})]
    cases += [
        Case("model beats lang", ROUTING, one(EN, model="multilingual", lang="en")),
        Case("model typed-decisions (not served)", ROUTING, one(model="typed-decisions"), differs=NOT_SERVED,
             ours=(422,), documented="typed-decisions"),
    ]
    return cases


def _task_lang() -> list[Case]:
    return [
        Case("task english", ROUTING, one(STATES["ru"], task="english")),
        Case("task multilingual", ROUTING, one(EN, task="multilingual")),
        Case("task alias ml", ROUTING, one(EN, task="ml")),
        Case("task beats lang", ROUTING, one(EN, task="multilingual", lang="en")),
        Case("task unknown", ROUTING, one(task="summarise"), text="prefix"),
        Case("task empty", ROUTING, one(task=""), text="prefix"),
        Case("task number", ROUTING, one(task=3), text="prefix"),
        Case("task typed_decisions (not served)", ROUTING, one(task="typed_decisions"), differs=NOT_SERVED,
             ours=(422,), documented="typed-decisions"),
        Case("lang de", ROUTING, one(EN, lang="de")),
        Case("lang en", ROUTING, one(STATES["ru"], lang="en")),
        Case("lang en-GB", ROUTING, one(STATES["ru"], lang="en-GB")),
        Case("lang EN", ROUTING, one(STATES["ru"], lang="EN")),
        Case("lang blank falls through", ROUTING, one(STATES["ru"], lang="  ")),
        Case("lang und", ROUTING, one(EN, lang="und")),
        Case("lang null", ROUTING, one(STATES["ru"], lang=None)),
        Case("lang number", ROUTING, one(lang=5)),
        Case("lang bool", ROUTING, one(lang=True)),
        Case("lang list", ROUTING, one(lang=["de"])),
        Case("lang_guess fr", ROUTING, one(EN, lang_guess="fr")),
        Case("lang_guess en", ROUTING, one(STATES["de"], lang_guess="en")),
        Case("lang beats lang_guess", ROUTING, one(EN, lang="en", lang_guess="fr")),
        Case("lang_guess number", ROUTING, one(lang_guess=1)),
        Case("lang_guess object", ROUTING, one(lang_guess={"code": "de"})),
    ]


def _controls() -> list[Case]:
    budgets = (("64", 64), ("8192 above the checkpoint", 8192), ("8193", 8193), ("0", 0), ("-5", -5),
               ("string", "64"), ("float", 64.0), ("bool", True), ("huge", 10 ** 30), ("null", None))
    heads = (("48", 48), ("9000", 9000), ("string", "x"), ("0", 0))
    thresholds = (("0.5", 0.5), ("0.99 abstains", 0.99), ("0", 0), ("1", 1), ("1.5", 1.5), ("-0.1", -0.1),
                  ("string", "0.5"), ("bool", True), ("list", [0.5]), ("null", None),
                  ("map", {"choice:3-5": 0.9, "default": 0.2}), ("map noul", {"noul:2": 0.95, "score:3-5": 0.1}),
                  ("map empty", {}), ("map bad key", {"choice": 0.5}), ("map bad value", {"default": 2}))
    cases = [Case("max_len %s" % k, CONTROLS, one(max_len=v)) for k, v in budgets]
    cases += [Case("head_max_len %s" % k, CONTROLS, one(head_max_len=v)) for k, v in heads]
    cases += [Case("min_confidence %s" % k, CONTROLS, one(min_confidence=v)) for k, v in thresholds]
    cases += [
        Case("max_len and head_max_len", CONTROLS, one(max_len=96, head_max_len=40)),
        Case("min_confidence NaN", CONTROLS,
             json.dumps(one()).replace('"questions"', '"min_confidence": NaN, "questions"', 1).encode(),
             differs="strict JSON: NaN / Infinity are not JSON values (400), where upstream's json.loads takes them",
             ours=(400,), documented="NaN"),
        Case("every body control at once", ROUTING,
             one(EN, model="english", task="multilingual", lang="de", lang_guess="fr", max_len=128,
                 head_max_len=64, min_confidence=0.3)),
    ]
    cases += [Case("refused %s" % k, CONTROLS, one(**{k: "x"})) for k in REFUSALS]
    cases += [Case("refused hooks_raise false", CONTROLS, one(hooks_raise=False)),
              Case("refused two at once", CONTROLS, one(hooks_timeout=1, hooks=[])),
              Case("refusal keys null are ignored", CONTROLS, one(hooks=None, hooks_timeout=None))]
    return cases


def _questions_and_limits() -> list[Case]:
    many_q = {"q%d" % i: QS["angry"] for i in range(65)}
    wide = {"q": {"type": "choice", "instructions": "pick", "criteria": ["o%d" % i for i in range(101)]}}
    levels = {"q": {"type": "score", "instructions": "rate", "criteria": ["l%d" % i for i in range(33)]}}
    total = {"q%d" % i: {"type": "choice", "instructions": "pick", "criteria": ["o%d" % j for j in range(100)]}
             for i in range(6)}
    return [
        Case("question type unknown", CONTROLS, one(EN, {"q": {"type": "rank", "instructions": "x",
                                                               "criteria": ["a"]}})),
        Case("choice without criteria", CONTROLS, one(EN, {"q": {"type": "choice", "instructions": "x"}})),
        Case("question not an object", CONTROLS, one(EN, {"q": "pick one"})),
        Case("score null level", CONTROLS, one(EN, {"q": {"type": "score", "instructions": "rate",
                                                          "criteria": ["low", None]}})),
        Case("labels on a choice", CONTROLS, one(EN, {"q": {"type": "choice", "instructions": "x",
                                                            "criteria": ["a", "b"], "labels": {"false": "n",
                                                                                               "true": "y"}}})),
        Case("64 questions", CONTROLS, one(EN, {"q%d" % i: QS["angry"] for i in range(64)})),
        Case("65 questions", CONTROLS, one(EN, many_q)),
        Case("101 choice options", CONTROLS, one(EN, wide)),
        Case("33 score levels", CONTROLS, one(EN, levels)),
        Case("600 options in all", CONTROLS, one(EN, total)),
        Case("instructions 9000 chars", CONTROLS,
             one(EN, {"q": {"type": "noul", "instructions": "is it late? " * 750}}), differs=OWN_LIMITS,
             ours=(413,), documented="max_instruction_chars"),
        Case("criterion 3000 chars", CONTROLS,
             one(EN, {"q": {"type": "choice", "instructions": "pick", "criteria": {"a": "x" * 3000, "b": "y"}}}),
             differs=OWN_LIMITS, ours=(413,), documented="max_criterion_chars"),
        Case("state 50001 chars", CONTROLS, one("a" * 50001)),
        Case("state dict over 50000 chars", CONTROLS, one({"t": "b" * 50010})),
        Case("body over 2 MiB", CONTROLS, one("c" * (2 * 1024 * 1024 + 10))),
        Case("lone surrogate", CONTROLS, b'{"state": "bad \\ud800 text", "questions": {"q": {"type": "noul", '
                                        b'"instructions": "x"}}}'),
        Case("paired surrogate emoji", CONTROLS, b'{"state": "ok \\ud83d\\ude00 text", "questions": {"q": '
                                                b'{"type": "noul", "instructions": "x"}}}'),
        Case("malformed JSON", CONTROLS, b'{"state": "x", "questions": '),
        Case("not JSON at all", CONTROLS, b"state=x&questions=y"),
        Case("empty body", CONTROLS, b""),
        Case("JSON array body", CONTROLS, [EN]),
        Case("JSON string body", CONTROLS, "hello"),
        Case("no questions key", CONTROLS, {"state": EN}),
        Case("no state key", CONTROLS, {"questions": QS}),
        Case("state null", CONTROLS, one(None)),
        Case("state number", CONTROLS, one(42)),
        Case("questions a list", CONTROLS, one(EN, [QS["angry"]])),
        Case("questions null", CONTROLS, one(EN, None) | {"questions": None}),
    ]


def _batch() -> list[Case]:
    return [
        Case("batch good", ROUTING, batch()),
        Case("batch scripts", ROUTING, batch([STATES[k] for k in ("zh", "ar", "en", "hi", "el", "digits")])),
        Case("batch model english", ROUTING, batch(model="english")),
        Case("batch model path", ROUTING, batch(model="./ckpt"), text="prefix"),
        Case("batch task multilingual", ROUTING, batch(task="multilingual")),
        Case("batch task unknown", ROUTING, batch(task="nope"), text="prefix"),
        Case("batch lang de", ROUTING, batch(lang="de")),
        Case("batch lang number", ROUTING, batch(lang=2)),
        Case("batch lang_guess en", ROUTING, batch(lang_guess="en")),
        Case("batch max_len 64", CONTROLS, batch(max_len=64)),
        Case("batch max_len 9000", CONTROLS, batch(max_len=9000)),
        Case("batch min_confidence 0.9", CONTROLS, batch(min_confidence=0.9)),
        Case("batch min_confidence map", CONTROLS, batch(min_confidence={"default": 0.6})),
        Case("batch min_confidence bad", CONTROLS, batch(min_confidence="high")),
    ] + [Case("batch batch_size %s" % k, CONTROLS, batch(batch_size=v))
         for k, v in (("2", 2), ("1000", 1000), ("0", 0), ("-1", -1), ("string", "2"), ("float", 2.0), ("bool", True))
         ] + [Case("batch sort_by_length %s" % k, CONTROLS, batch(sort_by_length=v))
              for k, v in (("true", True), ("false", False), ("string", "yes"), ("1", 1))] + [
        Case("batch diagnostics", CONTROLS, batch(diagnostics={})),
        Case("batch diagnostics null", CONTROLS, batch(diagnostics=None)),
    ] + [Case("batch refused %s" % k, CONTROLS, batch(**{k: 1})) for k in REFUSALS] + [
        Case("batch head_max_len 32", CONTROLS, batch(head_max_len=32)),
        Case("batch head_max_len 0", CONTROLS, batch(head_max_len=0)),
        Case("batch lang_guess number", ROUTING, batch(lang_guess=7)),
        Case("batch states empty", CONTROLS, batch([])),
        Case("batch states not a list", CONTROLS, batch(EN)),
        Case("batch no states key", CONTROLS, {"questions": QS}),
        Case("batch 65 states", CONTROLS, batch(["s"] * 65)),
        Case("batch one state null", CONTROLS, batch([EN, None])),
        Case("batch one state too large", CONTROLS, batch([EN, "d" * 50001])),
        Case("batch questions too many", CONTROLS, batch([EN], {"q%d" % i: QS["angry"] for i in range(65)})),
        Case("batch malformed JSON", CONTROLS, b'{"states": [', path=BATCH),
    ]


def _http() -> list[Case]:
    return [
        Case("no bearer", SERVING, one(), auth="none"),
        Case("wrong bearer", SERVING, one(), auth="wrong"),
        Case("key under another scheme", SERVING, one(), auth="scheme"),
        Case("batch no bearer", SERVING, batch(), path=BATCH, auth="none"),
        Case("no bearer and a bad body", SERVING, b"not json", auth="none"),
        Case("health authorized", SERVING, None, path="/health", method="GET"),
        Case("health no bearer", SERVING, None, path="/health", method="GET", auth="none"),
        Case("health wrong bearer", SERVING, None, path="/health", method="GET", auth="wrong"),
        Case("bearer scheme in lowercase", SERVING, one(), headers={"Authorization": "bearer " + API_KEY}),
        Case("bearer with a doubled space", SERVING, one(), headers={"Authorization": "Bearer  " + API_KEY}),
        Case("HEAD on health", SERVING, None, path="/health", method="HEAD", ours=(200,),
             differs="HEAD on a GET route answers as the GET does, without a body (upstream: 405)",
             documented="`HEAD` on every GET route"),
        Case("POST on health", SERVING, b"{}", path="/health"),
        Case("OPTIONS on the decision route", SERVING, None, method="OPTIONS"),
        Case("trailing slash", SERVING, one(), path=ONE + "/"),
        Case("GET on the decision route", SERVING, None, method="GET"),
        Case("docs hidden when a key is set", SERVING, None, path="/docs", method="GET"),
        Case("openapi hidden when a key is set", SERVING, None, path="/openapi.json", method="GET"),
        Case("unknown path", SERVING, None, path="/v2/systemone", method="GET", auth="none"),
        Case("readiness probe", SERVING, None, path="/ready", method="GET", auth="none", ours=(200,),
             differs="laya-fleet's readiness probe; upstream has none (404)", documented="/ready"),
    ]


def corpus() -> list[Case]:
    """Every request of the differential test, batch bodies sent to the batch route."""
    out = _good() + _models() + _task_lang() + _controls() + _questions_and_limits() + _http()
    for c in _batch():
        if c.path == ONE:
            c.path = BATCH
        out.append(c)
    names = [c.name for c in out]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    return out
