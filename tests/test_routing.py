"""Routing between served checkpoints: every control checked against upstream's own server functions and Router
(texts included), the language module on its own, and a generated set of 500 states in 35 languages and 17 scripts
routed by upstream's Router and by ours (docs/routing.md reports the table this test prints)."""

from __future__ import annotations

import collections
import importlib.util
import os
import random
import time
from types import SimpleNamespace

import pytest

from serve_app.online import language, routing
from serve_app.online.request_checks import HTTPError
from serve_app.online.routing import CheckpointRouter

ALL = {"english": "/ck/en", "multilingual": "/ck/ml", "typed-decisions": "/ck/td"}
ENGLISH = "Where is my order? It was supposed to arrive last week and tracking has not moved."
GERMAN = "Mein Konto wurde zweimal belastet und ich brauche eine Erstattung."
HINDI = "मेरा ऑर्डर कहाँ है? इसे पिछले हफ्ते आना था।"
QUESTIONS = {"urgent": {"type": "noul", "instructions": "Urgent?", "criteria": {"true": "yes", "false": "no"}}}
CUSTOMER_SERVICE = {k: QUESTIONS["urgent"] for k in ("action", "category", "churn_risk", "needs_human", "urgency")}


@pytest.fixture(scope="module")
def up():
    """Upstream's router and server modules (routing is pure there too: nothing is loaded)."""
    if importlib.util.find_spec("laya") is None:
        reason = "upstream laya==0.4.15 is the oracle of these tests (pip install -e '.[dev]')"
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    from laya import router, serve

    return SimpleNamespace(router=router, serve=serve, all=router.Router())


def upstream_route(up, router, state, questions=None, **body):
    """What upstream's server decides for a request body: its `_resolve_model`, language checks and `Router.route`,
    in its order; (status, detail) for a refusal."""
    from fastapi import HTTPException

    try:
        model = up.serve._resolve_model(body.get("model"), router.resolve)
        kwargs = {} if body.get("task") is None else {"task": body["task"]}
        for key in ("lang", "lang_guess"):
            if up.serve._validate_language_param(body, key) is not None:
                kwargs[key] = body[key]
        return dict(router.route(state, questions or {}, model=model, **kwargs))
    except HTTPException as e:
        return (e.status_code, e.detail)
    except ValueError as e:
        return (422, str(e))


def our_route(router, state, questions=None, **body):
    try:
        return router.route(state, questions or {}, **body)
    except HTTPError as e:
        return (e.status, e.detail)


def assert_same(up, ours, theirs, state=ENGLISH, questions=None, **body):
    """Both routers decide the same for this body: the same refusal text, or the same model, repo, reason and
    workflow (detection only where the state decided: that report is ours)."""
    a, b = upstream_route(up, theirs, state, questions, **body), our_route(ours, state, questions, **body)
    if isinstance(a, tuple) or isinstance(b, tuple):
        assert a == b, body
        return b
    assert list(b) == list(a) == ["model", "repo", "reason", "detection", "workflow"]
    assert {k: b[k] for k in ("model", "repo", "reason", "workflow")} == {
        k: a[k] for k in ("model", "repo", "reason", "workflow")}, body
    assert (b["detection"] is None) == (a["detection"] is None), body
    return b


# -- the tables: upstream's own data -------------------------------------------------------------------------------
def test_names_aliases_ids_and_workflows_are_upstreams(up):
    assert routing.ALIASES == up.router._ALIASES
    assert routing.WORKFLOWS == up.router._TYPED_DECISION_WORKFLOWS
    assert routing.PUBLISHED_IDS == up.serve._published_model_ids()
    assert routing.BUNDLE_REPO == up.router.BUNDLE_REPO
    assert routing.BUILTIN == {k: up.router._repo_str(v) for k, v in up.router.DEFAULT_MODELS.items()}


@pytest.mark.parametrize("name", ["english", " English ", "ML", "multi", "laya", "default", "typed_decisions",
                                  "Laya-Typed-Decisions", "papers", "jev-1", "", 5, True])
def test_canonical_name_is_upstreams(up, name):
    assert routing.canonical_name(name) == up.router.canonical_name(name)


@pytest.mark.parametrize("code", [None, "", "  ", "en", "EN", "en-US", "en_GB.UTF-8", "eng", "English", "de", "de-AT",
                                  "zh_Hant_TW", "C", "C.UTF-8", "POSIX", "und", "zxx", "mul", "xx", "-en", ".en"])
def test_language_codes_read_as_upstream_reads_them(up, code):
    assert routing.english_code(code) == up.router._english_from_code(code)


# -- model ---------------------------------------------------------------------------------------------------------
MODELS = ["english", "English ", "en", "laya", "default", "ml", "MULTI", "laya-multilingual", "multilingual",
          "typed-decisions", "typed", "decisions", "typed_decisions", "laya-typed-decisions",
          "convaiinnovations/laya-multilingual", " CONVAIINNOVATIONS/LAYA-MULTILINGUAL ",
          "convaiinnovations/laya-typed-decisions", "convaiinnovations/laya", "ConvaiInnovations/Laya",
          "jev-1", "auto", "gpt-4o", "laya-rl-agent", "  ", "", None, 0, False, True, 5, 1.5, [], {}, ["english"],
          "./ckpt", "~/ckpt", "~", ".", "/abs/path", "org/repo", "a\\b", ".hidden",
          "convaiinnovations/laya/multilingual", "convaiinnovations/laya-english", ["./x"], {"path": "a/b"}, "english/"]


@pytest.mark.parametrize("model", MODELS, ids=repr)
def test_model_as_upstream_reads_it(up, model):
    d = assert_same(up, CheckpointRouter(ALL), up.all, model=model)
    if isinstance(d, dict):
        assert d["model"] in ALL


def test_extra_names_pin_and_are_listed_in_the_refusal_as_upstreams(up):
    ours = CheckpointRouter({**ALL, "papers": "/ck/papers"})
    theirs = up.router.Router(models={"papers": "/ck/papers"})
    for model in ("./papers", "papers/v2", "paper", "jev-1"):
        assert_same(up, ours, theirs, model=model)
    for model in ("papers", "Papers", " PAPERS "):
        a, b = upstream_route(up, theirs, ENGLISH, model=model), our_route(ours, ENGLISH, model=model)
        assert (b["model"], b["reason"]) == (a["model"], a["reason"]) == ("papers", "explicit model='papers'")
        assert b["repo"] is None and a["repo"] == "/ck/papers"   # a directory is never reported here


# -- task ----------------------------------------------------------------------------------------------------------
TASKS = ["typed_decisions", "typed-decisions", "Typed-Decisions", "TYPED_DECISIONS ", "typed", "decisions",
         "english", "ml", "multilingual", "summarise", "", " ", 5, 0, True, False, ["typed_decisions"], {"a": 1}]


@pytest.mark.parametrize("task", TASKS, ids=repr)
def test_task_as_upstream_reads_it(up, task):
    assert_same(up, CheckpointRouter(ALL), up.all, task=task)
    assert_same(up, CheckpointRouter(ALL), up.all, state=HINDI, task=task, lang="en")


@pytest.mark.parametrize("model", ["english", "ml", "jev-1", "./x"])
def test_model_comes_before_task(up, model):
    assert_same(up, CheckpointRouter(ALL), up.all, model=model, task="no-such-task")


# -- lang and lang_guess -------------------------------------------------------------------------------------------
LANGS = ["de", "en", "EN", "en-US", "en_US.UTF-8", "English", "fr-CA", "zh-Hant", "C", "C.UTF-8", "POSIX", "und",
         "zxx", "mul", "", "   ", "xx", "%s", "en-%d", 5, 0, True, False, ["en"], {"code": "en"}, 1.0]


@pytest.mark.parametrize("key", ["lang", "lang_guess"])
@pytest.mark.parametrize("value", LANGS, ids=repr)
def test_language_hints_as_upstream_reads_them(up, key, value):
    for state in (ENGLISH, HINDI, GERMAN, "12345"):
        assert_same(up, CheckpointRouter(ALL), up.all, state=state, **{key: value})


@pytest.mark.parametrize("body", [
    dict(lang="de", lang_guess="en"), dict(lang="C", lang_guess="de"), dict(lang="", lang_guess="en-GB"),
    dict(lang="und", lang_guess="und"), dict(model="english", lang="de"), dict(task="ml", lang="en"),
    dict(model="./x", lang=5), dict(model="english", lang=5), dict(lang=5, lang_guess=True),
    dict(lang="de", lang_guess=["x"]), dict(lang=True, task="nope"), dict(task="nope", lang="de"),
    dict(model="jev-1", task="typed_decisions", lang="de"), dict(model=None, task=None, lang=None, lang_guess=None),
], ids=repr)
def test_precedence_and_the_order_of_refusals_are_upstreams(up, body):
    assert_same(up, CheckpointRouter(ALL), up.all, state=HINDI, questions=CUSTOMER_SERVICE, **body)


# -- workflows, default, states without letters --------------------------------------------------------------------
def test_workflow_is_reported_and_routes_only_when_asked(up):
    for lang in (None, "de"):
        d = assert_same(up, CheckpointRouter(ALL), up.all, questions=CUSTOMER_SERVICE, lang=lang)
        assert d["workflow"] == "customer_service" and d["model"] == ("english" if lang is None else "multilingual")
    auto = up.router.Router(auto_task_detection=True)
    d = assert_same(up, CheckpointRouter(ALL, auto_task=True), auto, questions=CUSTOMER_SERVICE)
    assert d["model"] == "typed-decisions"
    assert assert_same(up, CheckpointRouter(ALL, auto_task=True), auto, questions=QUESTIONS)["workflow"] is None
    # explicit model and task report no workflow, as upstream's
    assert assert_same(up, CheckpointRouter(ALL), up.all, questions=CUSTOMER_SERVICE, model="ml")["workflow"] is None


@pytest.mark.parametrize("state", ["", "   ", "12345 !!! 42", {}, [], {"id": 7, "ok": True}, [1, 2.5, None],
                                   {"nested": {"deeper": ["?!", "1-2-3"]}}, ":-) <3 ++"], ids=repr)
@pytest.mark.parametrize("default", ["multilingual", "english"])
def test_states_without_letters_take_the_default(up, state, default):
    d = assert_same(up, CheckpointRouter(ALL, default=default), up.router.Router(default=default), state=state)
    assert d["model"] == default and d["reason"] == "no letters detected in state; using default (%s)" % default


@pytest.mark.parametrize("state,undecided", [("Quero cancelar", True), ("Reset password", True), ("ok", True),
                                             ("Olá", False), ("Ça va ?", False), ("Größe", False)])
def test_short_latin_text_takes_the_default_unless_accented(up, state, undecided):
    for default in ("multilingual", "english"):
        d = CheckpointRouter(ALL, default=default).route(state, {})
        assert d["model"] == upstream_route(up, up.router.Router(default=default), state)["model"]
        assert d["model"] == (default if undecided else "multilingual"), (state, default)


def test_english_and_non_latin_reasons_read_as_upstreams(up):
    ours, theirs = CheckpointRouter(ALL), up.all
    assert ours.route(ENGLISH, {})["reason"] == theirs.route(ENGLISH, {})["reason"] == "English Latin text"
    for state in (HINDI, "Где мой заказ? Он должен был прийти на прошлой неделе."):
        a, b = ours.route(state, {})["reason"], theirs.route(state, {})["reason"]
        assert a == b and a.startswith("non-Latin script (")


# -- served names only ---------------------------------------------------------------------------------------------
def test_an_unserved_upstream_name_is_refused_when_named():
    two = CheckpointRouter({"english": "/ck/en", "multilingual": "/ck/ml"})
    for body in (dict(model="typed-decisions"), dict(model="convaiinnovations/laya-typed-decisions"),
                 dict(model="typed"), dict(task="typed_decisions")):
        with pytest.raises(HTTPError) as e:
            two.route(ENGLISH, {}, **body)
        assert e.value.status == 422 and "is not served here; this service serves ['english', 'multilingual']" in (
            e.value.detail)


def test_an_automatic_choice_of_an_unserved_name_falls_to_the_default():
    en = CheckpointRouter({"english": "/ck/en"})
    assert en.default == "english" and en.names == ["english"]
    for state, body in ((HINDI, {}), (GERMAN, {}), (ENGLISH, dict(lang="de")), (ENGLISH, dict(lang_guess="ru"))):
        d = en.route(state, {}, **body)
        assert d["model"] == "english" and d["reason"].endswith(
            "; multilingual is not served here, so the default (english) answers")
    ml = CheckpointRouter({"multilingual": "/ck/ml", "papers": "/ck/p"})
    assert ml.route(ENGLISH, {})["model"] == "multilingual"
    assert ml.route(ENGLISH, {}, model="papers")["model"] == "papers"


def test_constructor_checks_names_and_default():
    r = CheckpointRouter({"EN": "/a", "ml": "/b", "Papers.v2": "/c"}, default="en")
    assert r.names == ["english", "multilingual", "papers.v2"] and r.default == "english"
    assert r.resolve("Laya") == "english" and r.resolve("PAPERS.V2") == "papers.v2"
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        r.resolve("nope")
    for bad in ({}, {"auto": "/a"}, {"a/b": "/a"}, {"-x": "/a"}, {"": "/a"}, {5: "/a"}, {"en": "/a", "English": "/b"}):
        with pytest.raises(ValueError):
            CheckpointRouter(bad)
    with pytest.raises(ValueError, match="default checkpoint 'typed' is not served"):
        CheckpointRouter({"english": "/a"}, default="typed")


# -- the language module -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ch,script", [("a", "latin"), ("é", "latin"), ("ß", "latin"), ("Ａ", "latin"), ("ɐ", "latin"),
                                       ("я", "cyrillic"), ("Ω", "greek"), ("ب", "arabic"), ("ש", "hebrew"),
                                       ("क", "devanagari"), ("ক", "bengali"), ("த", "tamil"), ("ก", "thai"),
                                       ("ა", "georgian"), ("ա", "armenian"), ("ሰ", "ethiopic"), ("中", "han"),
                                       ("\U00020000", "han"), ("あ", "kana"), ("ア", "kana"), ("ｱ", "kana"),
                                       ("한", "hangul"), ("ᄀ", "hangul"), ("ﾡ", "hangul"), ("ខ", "khmer"),
                                       ("\u0301", "mark"), ("1", None), ("-", None), (" ", None), ("ʼ", None)])
def test_script_of_reads_unicode_names(ch, script):
    assert language.script_of(ch) == script


@pytest.mark.parametrize("state,english", [
    ("Please call Дмитрий Петрович tomorrow about the second invoice for the order.", True),   # a name
    ("Set α to 0.05 and β to 0.1 in the config file, then restart the service please.", True),   # symbols
    ("The customer wrote 谢谢 at the end of the message about the late delivery of the order.", True),
    ("iPhone 15 Pro Maxの注文について", False),                   # kana/han carry a mostly-Latin text
    ("Please help, my order says: 我的订单在哪里？本来应该上周就到的。", False),
    ("Contact support@example.com or visit https://example.com/help/orders for the status of your order", True),
    ({"subject": "Order 5521", "body": "Hello,\nMinha encomenda chegou danificada e a caixa estava aberta.\nThanks"},
     False),
    (["Thanks, I am checking this for you now.", "Where is my order? It was due last week."], True),
])
def test_detect_names_symbols_and_mixed_lines(state, english):
    d = CheckpointRouter(ALL).route(state, {})
    assert (d["model"] == "english") is english, d


def test_long_tokens_cost_linear_time():
    for token in ("a" * 200_000, "a_" * 100_000, "x@" * 100_000, "ab." * 70_000, "\u0915" * 200_000):
        t = time.perf_counter()
        language.detect(token)
        language.identify(token)
        assert time.perf_counter() - t < 1.0, token[:8]


def test_reading_is_bounded():
    parts = language.leaves({"a": ["x" * 10_000] * 10, "b": [[[[[[[[[["deep"]]]]]]]]]]})
    assert len(parts) == 4 and all(len(p) <= language.CHAR_BUDGET for p in parts)
    assert sum(map(len, parts)) <= language.TOTAL_BUDGET
    assert language.leaves([b"caf\xc3\xa9", bytearray(b"ok"), 5, None]) == ["café", "ok"]


# -- the generated set ---------------------------------------------------------------------------------------------
# One customer-support message per line, per language: 19 Latin-script languages and 16 languages in 16 other scripts
SENTENCES = {
    "en": ["Where is my order? It was supposed to arrive last week.",
           "I was charged twice for the same invoice and need a refund.",
           "Can you help me reset my password, please?",
           "The app crashes every time I open the settings page.",
           "Please cancel my subscription before the next billing date.",
           "My package arrived damaged and the box was open.",
           "I would like to change the delivery address for this order.",
           "Why has my account been locked after the update?",
           "The tracking number you sent me does not work.",
           "We have not received the payment confirmation yet."],
    "fr": ["Où est ma commande ? Elle devait arriver la semaine dernière.",
           "J'ai été débité deux fois pour la même facture.",
           "Pouvez-vous m'aider à réinitialiser mon mot de passe ?",
           "L'application plante chaque fois que j'ouvre les paramètres.",
           "Merci d'annuler mon abonnement avant la prochaine échéance.",
           "Mon colis est arrivé abîmé et la boîte était ouverte.",
           "Je voudrais changer l'adresse de livraison de cette commande.",
           "Pourquoi mon compte a-t-il été bloqué après la mise à jour ?",
           "Le numéro de suivi que vous m'avez envoyé ne fonctionne pas.",
           "Nous n'avons toujours pas reçu la confirmation du paiement."],
    "de": ["Wo ist meine Bestellung? Sie sollte letzte Woche ankommen.",
           "Mir wurde dieselbe Rechnung zweimal belastet.",
           "Können Sie mir helfen, mein Passwort zurückzusetzen?",
           "Die App stürzt jedes Mal ab, wenn ich die Einstellungen öffne.",
           "Bitte kündigen Sie mein Abo vor dem nächsten Abrechnungstermin.",
           "Mein Paket kam beschädigt an und der Karton war offen.",
           "Ich möchte die Lieferadresse für diese Bestellung ändern.",
           "Warum wurde mein Konto nach dem Update gesperrt?",
           "Die Sendungsnummer, die Sie mir geschickt haben, funktioniert nicht.",
           "Wir haben die Zahlungsbestätigung noch nicht erhalten."],
    "es": ["¿Dónde está mi pedido? Tenía que llegar la semana pasada.",
           "Me cobraron dos veces la misma factura y necesito un reembolso.",
           "¿Pueden ayudarme a restablecer mi contraseña, por favor?",
           "La aplicación se cierra cada vez que abro la configuración.",
           "Por favor cancelen mi suscripción antes de la próxima fecha de cobro.",
           "Mi paquete llegó dañado y la caja estaba abierta.",
           "Quisiera cambiar la dirección de entrega de este pedido.",
           "¿Por qué bloquearon mi cuenta después de la actualización?",
           "El número de seguimiento que me enviaron no funciona.",
           "Todavía no hemos recibido la confirmación del pago."],
    "pt": ["Onde está o meu pedido? Ele deveria ter chegado na semana passada.",
           "Fui cobrado duas vezes pela mesma fatura e preciso de reembolso.",
           "Vocês podem me ajudar a redefinir minha senha?",
           "O aplicativo fecha toda vez que abro as configurações.",
           "Por favor cancelem a minha assinatura antes da próxima cobrança.",
           "Minha encomenda chegou danificada e a caixa estava aberta.",
           "Gostaria de mudar o endereço de entrega deste pedido.",
           "Por que minha conta foi bloqueada depois da atualização?",
           "O código de rastreio que vocês enviaram não funciona.",
           "Ainda não recebemos a confirmação do pagamento."],
    "it": ["Dov'è il mio ordine? Doveva arrivare la settimana scorsa.",
           "Mi è stata addebitata due volte la stessa fattura.",
           "Potete aiutarmi a reimpostare la mia password?",
           "L'app si chiude ogni volta che apro le impostazioni.",
           "Vi prego di annullare il mio abbonamento prima del prossimo addebito.",
           "Il mio pacco è arrivato danneggiato e la scatola era aperta.",
           "Vorrei cambiare l'indirizzo di consegna di questo ordine.",
           "Perché il mio account è stato bloccato dopo l'aggiornamento?",
           "Il numero di tracciamento che mi avete inviato non funziona.",
           "Non abbiamo ancora ricevuto la conferma del pagamento."],
    "nl": ["Waar is mijn bestelling? Die zou vorige week aankomen.",
           "Ik heb twee keer voor dezelfde factuur betaald.",
           "Kunt u mij helpen mijn wachtwoord opnieuw in te stellen?",
           "De app crasht elke keer als ik de instellingen open.",
           "Zeg alstublieft mijn abonnement op voor de volgende afschrijving.",
           "Mijn pakket is beschadigd aangekomen en de doos was open.",
           "Ik wil het bezorgadres van deze bestelling wijzigen.",
           "Waarom is mijn account na de update geblokkeerd?",
           "Het trackingnummer dat u mij stuurde werkt niet.",
           "We hebben de betalingsbevestiging nog niet ontvangen."],
    "sv": ["Var är min beställning? Den skulle komma förra veckan.",
           "Jag har debiterats två gånger för samma faktura.",
           "Kan ni hjälpa mig att återställa mitt lösenord?",
           "Appen kraschar varje gång jag öppnar inställningarna.",
           "Avsluta mitt abonnemang före nästa dragning, tack.",
           "Mitt paket kom fram skadat och lådan var öppen.",
           "Jag vill ändra leveransadressen för den här beställningen.",
           "Varför har mitt konto låsts efter uppdateringen?",
           "Spårningsnumret som ni skickade fungerar inte.",
           "Vi har fortfarande inte fått betalningsbekräftelsen."],
    "da": ["Hvor er min ordre? Den skulle være kommet i sidste uge.",
           "Jeg er blevet trukket to gange for den samme faktura.",
           "Kan I hjælpe mig med at nulstille min adgangskode?",
           "Appen lukker ned hver gang jeg åbner indstillingerne.",
           "Opsig venligst mit abonnement før næste betaling.",
           "Min pakke kom frem beskadiget, og kassen var åben.",
           "Jeg vil gerne ændre leveringsadressen på denne ordre.",
           "Hvorfor er min konto blevet spærret efter opdateringen?"],
    "pl": ["Gdzie jest moje zamówienie? Miało przyjść w zeszłym tygodniu.",
           "Zostałem obciążony dwa razy za tę samą fakturę.",
           "Czy możecie pomóc mi zresetować hasło?",
           "Aplikacja zawiesza się za każdym razem, gdy otwieram ustawienia.",
           "Proszę anulować moją subskrypcję przed następną płatnością.",
           "Moja paczka dotarła uszkodzona, a pudełko było otwarte.",
           "Chciałbym zmienić adres dostawy tego zamówienia.",
           "Dlaczego moje konto zostało zablokowane po aktualizacji?"],
    "cs": ["Kde je moje objednávka? Měla dorazit minulý týden.",
           "Byla mi dvakrát stržena platba za stejnou fakturu.",
           "Můžete mi pomoci obnovit heslo?",
           "Aplikace spadne pokaždé, když otevřu nastavení.",
           "Prosím zrušte moje předplatné před další platbou.",
           "Můj balík dorazil poškozený a krabice byla otevřená.",
           "Chtěl bych změnit doručovací adresu této objednávky.",
           "Proč byl můj účet po aktualizaci zablokován?"],
    "tr": ["Siparişim nerede? Geçen hafta gelmesi gerekiyordu.",
           "Aynı fatura için iki kez ücret alındı.",
           "Şifremi sıfırlamama yardım edebilir misiniz?",
           "Ayarları her açtığımda uygulama çöküyor.",
           "Lütfen bir sonraki ödemeden önce aboneliğimi iptal edin.",
           "Paketim hasarlı geldi ve kutu açıktı.",
           "Bu siparişin teslimat adresini değiştirmek istiyorum.",
           "Güncellemeden sonra hesabım neden kilitlendi?"],
    "vi": ["Đơn hàng của tôi đâu rồi? Lẽ ra nó phải đến tuần trước.",
           "Tôi bị trừ tiền hai lần cho cùng một hóa đơn.",
           "Bạn có thể giúp tôi đặt lại mật khẩu không?",
           "Ứng dụng bị treo mỗi khi tôi mở phần cài đặt.",
           "Vui lòng hủy gói đăng ký của tôi trước kỳ thanh toán tới.",
           "Gói hàng của tôi bị hư hỏng và hộp đã bị mở.",
           "Tôi muốn thay đổi địa chỉ giao hàng cho đơn này.",
           "Tại sao tài khoản của tôi bị khóa sau khi cập nhật?"],
    "id": ["Di mana pesanan saya? Seharusnya sudah sampai minggu lalu.",
           "Saya ditagih dua kali untuk faktur yang sama.",
           "Bisakah Anda membantu saya mengatur ulang kata sandi?",
           "Aplikasinya selalu macet setiap kali saya membuka pengaturan.",
           "Tolong batalkan langganan saya sebelum tanggal tagihan berikutnya.",
           "Paket saya datang dalam keadaan rusak dan kotaknya terbuka.",
           "Saya ingin mengubah alamat pengiriman untuk pesanan ini.",
           "Mengapa akun saya dikunci setelah pembaruan?"],
    "ro": ["Unde este comanda mea? Trebuia să ajungă săptămâna trecută.",
           "Am fost taxat de două ori pentru aceeași factură.",
           "Mă puteți ajuta să îmi resetez parola?",
           "Aplicația se blochează de fiecare dată când deschid setările.",
           "Vă rog să îmi anulați abonamentul înainte de următoarea plată.",
           "Coletul meu a ajuns deteriorat și cutia era deschisă.",
           "Aș dori să schimb adresa de livrare pentru această comandă.",
           "De ce mi-a fost blocat contul după actualizare?"],
    "hu": ["Hol van a rendelésem? Múlt héten kellett volna megérkeznie.",
           "Kétszer vonták le ugyanazt a számlát.",
           "Tudnának segíteni visszaállítani a jelszavamat?",
           "Az alkalmazás minden alkalommal összeomlik, amikor megnyitom a beállításokat.",
           "Kérem, mondják le az előfizetésemet a következő terhelés előtt.",
           "A csomagom sérülten érkezett, és a doboz nyitva volt.",
           "Szeretném megváltoztatni a rendelés szállítási címét.",
           "Miért lett zárolva a fiókom a frissítés után?"],
    "fi": ["Missä tilaukseni on? Sen piti saapua viime viikolla.",
           "Minulta veloitettiin sama lasku kahdesti.",
           "Voitteko auttaa minua palauttamaan salasanani?",
           "Sovellus kaatuu aina, kun avaan asetukset.",
           "Peruuttakaa tilaukseni ennen seuraavaa veloitusta.",
           "Pakettini saapui vaurioituneena ja laatikko oli auki.",
           "Haluaisin vaihtaa tämän tilauksen toimitusosoitteen.",
           "Miksi tilini lukittiin päivityksen jälkeen?"],
    "tl": ["Nasaan na ang order ko? Dapat dumating ito noong nakaraang linggo.",
           "Dalawang beses akong siningil para sa parehong invoice.",
           "Pwede po ba ninyo akong tulungang i-reset ang password ko?",
           "Nagsasara ang app tuwing binubuksan ko ang settings.",
           "Pakikansela po ang subscription ko bago ang susunod na singil.",
           "Dumating na sira ang package ko at bukas na ang kahon.",
           "Gusto kong palitan ang address ng delivery para sa order na ito.",
           "Bakit na-lock ang account ko pagkatapos ng update?"],
    "sw": ["Agizo langu liko wapi? Lilipaswa kufika wiki iliyopita.",
           "Nimetozwa mara mbili kwa ankara ileile.",
           "Mnaweza kunisaidia kubadilisha nenosiri langu?",
           "Programu inazimika kila ninapofungua mipangilio.",
           "Tafadhali sitisheni usajili wangu kabla ya malipo yanayofuata.",
           "Kifurushi changu kilifika kikiwa kimeharibika na sanduku lilikuwa wazi.",
           "Ningependa kubadilisha anwani ya kupeleka agizo hili.",
           "Kwa nini akaunti yangu imefungwa baada ya sasisho?"],
    "ru": ["Где мой заказ? Он должен был прийти на прошлой неделе.",
           "С меня дважды списали деньги за один и тот же счёт.",
           "Помогите, пожалуйста, сбросить пароль.",
           "Приложение вылетает каждый раз, когда я открываю настройки.",
           "Пожалуйста, отмените мою подписку до следующего списания.",
           "Посылка пришла повреждённой, коробка была вскрыта.",
           "Я хочу изменить адрес доставки для этого заказа.",
           "Почему мой аккаунт заблокировали после обновления?"],
    "uk": ["Де моє замовлення? Воно мало прийти минулого тижня.",
           "З мене двічі зняли гроші за той самий рахунок.",
           "Допоможіть, будь ласка, скинути пароль.",
           "Застосунок вилітає щоразу, коли я відкриваю налаштування.",
           "Будь ласка, скасуйте мою підписку до наступного списання.",
           "Посилка прийшла пошкодженою, а коробка була відкрита.",
           "Я хочу змінити адресу доставки цього замовлення.",
           "Чому мій акаунт заблокували після оновлення?"],
    "el": ["Πού είναι η παραγγελία μου; Έπρεπε να έρθει την περασμένη εβδομάδα.",
           "Χρεώθηκα δύο φορές για το ίδιο τιμολόγιο.",
           "Μπορείτε να με βοηθήσετε να επαναφέρω τον κωδικό μου;",
           "Η εφαρμογή κλείνει κάθε φορά που ανοίγω τις ρυθμίσεις.",
           "Παρακαλώ ακυρώστε τη συνδρομή μου πριν την επόμενη χρέωση.",
           "Το δέμα μου έφτασε χαλασμένο και το κουτί ήταν ανοιχτό.",
           "Θα ήθελα να αλλάξω τη διεύθυνση παράδοσης αυτής της παραγγελίας.",
           "Γιατί κλειδώθηκε ο λογαριασμός μου μετά την ενημέρωση;"],
    "ar": ["أين طلبي؟ كان من المفترض أن يصل الأسبوع الماضي.",
           "تم خصم المبلغ مرتين لنفس الفاتورة.",
           "هل يمكنكم مساعدتي في إعادة تعيين كلمة المرور؟",
           "التطبيق يتوقف كلما فتحت الإعدادات.",
           "يرجى إلغاء اشتراكي قبل موعد الدفع القادم.",
           "وصل الطرد تالفًا وكان الصندوق مفتوحًا.",
           "أريد تغيير عنوان التوصيل لهذا الطلب.",
           "لماذا تم قفل حسابي بعد التحديث؟"],
    "fa": ["سفارش من کجاست؟ قرار بود هفته پیش برسد.",
           "برای یک فاکتور دو بار از من پول کم شد.",
           "می‌توانید کمکم کنید رمز عبورم را بازنشانی کنم؟",
           "برنامه هر بار که تنظیمات را باز می‌کنم بسته می‌شود.",
           "لطفاً اشتراک من را قبل از پرداخت بعدی لغو کنید.",
           "بسته من آسیب‌دیده رسید و جعبه باز بود."],
    "he": ["איפה ההזמנה שלי? היא הייתה אמורה להגיע בשבוע שעבר.",
           "חייבו אותי פעמיים על אותה חשבונית.",
           "אתם יכולים לעזור לי לאפס את הסיסמה?",
           "האפליקציה קורסת בכל פעם שאני פותח את ההגדרות.",
           "נא לבטל את המנוי שלי לפני החיוב הבא.",
           "החבילה הגיעה פגומה והקופסה הייתה פתוחה.",
           "אני רוצה לשנות את כתובת המשלוח של ההזמנה הזו."],
    "hi": ["मेरा ऑर्डर कहाँ है? इसे पिछले हफ्ते आना था।",
           "एक ही बिल के लिए मुझसे दो बार पैसे काटे गए।",
           "क्या आप मेरा पासवर्ड रीसेट करने में मदद कर सकते हैं?",
           "जब भी मैं सेटिंग्स खोलता हूँ, ऐप बंद हो जाता है।",
           "कृपया अगले भुगतान से पहले मेरी सदस्यता रद्द कर दें।",
           "मेरा पार्सल टूटा हुआ आया और डिब्बा खुला था।",
           "मैं इस ऑर्डर का डिलीवरी पता बदलना चाहता हूँ।"],
    "bn": ["আমার অর্ডার কোথায়? গত সপ্তাহে আসার কথা ছিল।",
           "একই বিলের জন্য আমার কাছ থেকে দুবার টাকা কাটা হয়েছে।",
           "আপনারা কি আমার পাসওয়ার্ড রিসেট করতে সাহায্য করতে পারবেন?",
           "সেটিংস খুললেই অ্যাপটি বন্ধ হয়ে যায়।",
           "পরবর্তী পেমেন্টের আগে আমার সাবস্ক্রিপশন বাতিল করুন।"],
    "ta": ["என் ஆர்டர் எங்கே? கடந்த வாரம் வந்திருக்க வேண்டும்.",
           "ஒரே பில்லுக்கு இரண்டு முறை பணம் எடுக்கப்பட்டது.",
           "என் கடவுச்சொல்லை மீட்டமைக்க உதவ முடியுமா?",
           "அமைப்புகளைத் திறக்கும் ஒவ்வொரு முறையும் செயலி மூடுகிறது.",
           "அடுத்த கட்டணத்திற்கு முன் என் சந்தாவை ரத்து செய்யுங்கள்."],
    "th": ["คำสั่งซื้อของฉันอยู่ที่ไหน ควรจะมาถึงตั้งแต่สัปดาห์ที่แล้ว",
           "ฉันถูกเรียกเก็บเงินสองครั้งสำหรับใบแจ้งหนี้เดียวกัน",
           "ช่วยรีเซ็ตรหัสผ่านให้ฉันได้ไหม",
           "แอปปิดตัวเองทุกครั้งที่ฉันเปิดหน้าตั้งค่า",
           "กรุณายกเลิกการสมัครสมาชิกของฉันก่อนรอบบิลถัดไป",
           "พัสดุของฉันมาถึงในสภาพเสียหายและกล่องถูกเปิดแล้ว"],
    "ka": ["სად არის ჩემი შეკვეთა? წინა კვირას უნდა მოსულიყო.",
           "ერთი და იგივე ინვოისისთვის ორჯერ ჩამომეჭრა თანხა.",
           "შეგიძლიათ დამეხმაროთ პაროლის აღდგენაში?",
           "აპლიკაცია ყოველ ჯერზე იხურება, როცა პარამეტრებს ვხსნი.",
           "გთხოვთ, გააუქმოთ ჩემი გამოწერა შემდეგ გადახდამდე."],
    "hy": ["Որտե՞ղ է իմ պատվերը։ Այն պետք է հասներ անցյալ շաբաթ։",
           "Նույն հաշվի համար ինձնից երկու անգամ գումար են գանձել։",
           "Կարո՞ղ եք օգնել վերականգնել գաղտնաբառս։",
           "Հավելվածը փակվում է ամեն անգամ, երբ բացում եմ կարգավորումները։"],
    "am": ["ትዕዛዜ የት ነው? ባለፈው ሳምንት መድረስ ነበረበት።",
           "ለአንድ ደረሰኝ ሁለት ጊዜ ተከፍያለሁ።",
           "የይለፍ ቃሌን እንደገና ለማስጀመር ልትረዱኝ ትችላላችሁ?",
           "ቅንብሮችን በከፈትኩ ቁጥር መተግበሪያው ይዘጋል።"],
    "zh": ["我的订单在哪里？本来应该上周就到的。",
           "同一张发票被扣了两次款。",
           "你们能帮我重置密码吗？",
           "每次打开设置页面，应用就会崩溃。",
           "请在下次扣款之前取消我的订阅。",
           "我的包裹到的时候已经损坏，箱子也被打开了。",
           "我想修改这个订单的收货地址。",
           "为什么更新之后我的账户被锁定了？"],
    "ja": ["注文した商品はどこですか？先週届くはずでした。",
           "同じ請求書で二回引き落とされました。",
           "パスワードの再設定を手伝ってもらえますか？",
           "設定を開くたびにアプリが落ちます。",
           "次回の請求日の前にサブスクリプションを解約してください。",
           "荷物が壊れた状態で届き、箱も開いていました。",
           "この注文の配送先住所を変更したいです。",
           "アップデート後にアカウントがロックされたのはなぜですか？"],
    "ko": ["제 주문은 어디 있나요? 지난주에 도착했어야 했어요.",
           "같은 청구서로 두 번 결제되었습니다.",
           "비밀번호 재설정을 도와주실 수 있나요?",
           "설정을 열 때마다 앱이 종료됩니다.",
           "다음 결제일 전에 구독을 해지해 주세요.",
           "택배가 파손된 채로 도착했고 상자가 열려 있었어요.",
           "이 주문의 배송 주소를 바꾸고 싶어요.",
           "업데이트 후에 왜 계정이 잠겼나요?"],
}
NON_LATIN = {"ru", "uk", "el", "ar", "fa", "he", "hi", "bn", "ta", "th", "ka", "hy", "am", "zh", "ja", "ko"}
FORMS = ("one", "two", "dict", "thread", "list", "short", "forwarded", "with_ids")


def generated_states(n: int = 500, seed: int = 24) -> list[tuple[str, str, object]]:
    """(language, form, state) x n, deterministic: English one state in five (the largest language of such traffic),
    the other 34 languages in turn; each state one of FORMS, as strings, dicts and lists, as upstream accepts."""
    rng = random.Random(seed)
    others = sorted(lg for lg in SENTENCES if lg != "en")
    out = []
    for i in range(n):
        lg = "en" if i % 5 == 0 else others[(i - i // 5 - 1) % len(others)]
        a, b = rng.sample(SENTENCES[lg], 2)
        form = rng.choice(FORMS)
        state = {
            "one": a,
            "two": a + rng.choice([" ", "\n"]) + b,
            "dict": {"subject": " ".join(b.split()[:4]), "body": a, "order_id": rng.randint(1000, 99999),
                     "channel": "email"},
            "thread": [{"role": "user", "content": a}, {"role": "assistant", "content": b}],
            "list": [a, b],
            "short": " ".join(a.split()[:2]),
            "forwarded": {"note": "Forwarded by the front desk, ticket #%d. Customer wrote:" % rng.randint(100, 999),
                          "message": a, "tags": ["email", "priority-2"]},
            "with_ids": "%s Order ID: ORD-%d, SKU WH-1000XM5, https://shop.example.com/o/%d" % (
                a, rng.randint(10000, 99999), rng.randint(100, 999)),
        }[form]
        out.append((lg, form, state))
    return out


def test_generated_set_routes_as_upstream(up, capsys):
    ours, theirs = CheckpointRouter({"english": "/ck/en", "multilingual": "/ck/ml"}), up.all
    states = generated_states()
    ours.warm()
    assert len({lg for lg, _, _ in states}) >= 20 and {type(s) for _, _, s in states} == {str, dict, list}
    same, total, differ, wrong = collections.Counter(), collections.Counter(), [], collections.Counter()
    spent = 0.0
    for lg, form, state in states:
        t = time.perf_counter()
        mine = ours.route(state, QUESTIONS)
        spent += time.perf_counter() - t
        theirs_ = theirs.route(state, QUESTIONS)
        total[lg] += 1
        truth = "english" if lg == "en" and form != "short" else "multilingual"
        for who, d in (("ours", mine), ("upstream", theirs_)):
            wrong[who] += d["model"] != truth
        if mine["model"] == theirs_["model"]:
            same[lg] += 1
        else:
            differ.append((lg, form, theirs_["model"], mine["model"], theirs_["reason"][:48], mine["reason"][:64]))
    with capsys.disabled():
        print("\nrouting agreement with upstream, per language (%d states, %.3f ms per state here):"
              % (len(states), 1000 * spent / len(states)))
        print(" ".join("%s %d/%d" % (lg, same[lg], total[lg]) for lg in sorted(total)))
        for row in differ:
            print("  %s %-9s upstream %s, ours %s | upstream: %s | ours: %s" % row)
        print("against the language each state is written in: upstream %d wrong, ours %d" % (
            wrong["upstream"], wrong["ours"]))
    non_latin = [lg for lg in total if lg in NON_LATIN]
    assert sum(same[lg] for lg in non_latin) == sum(total[lg] for lg in non_latin)
    assert sum(same.values()) >= 0.95 * len(states)
    assert wrong["ours"] <= wrong["upstream"]
    assert spent / len(states) < 0.005
