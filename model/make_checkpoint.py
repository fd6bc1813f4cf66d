"""`laya-fleet make-checkpoint`: a complete Laya bundle with random weights and a real BPE tokenizer.

The tokenizer is trained offline on a corpus generated from a fixed word list and a seeded RNG, so the
same seed gives byte-identical files on any machine: a byte-level BPE for most shapes, a
SentencePiece-style BPE with byte fallback over many scripts for `tiny-multilingual` (shaped like the
published multilingual checkpoint, whose config it also follows). Weights are random with real
layouts (ModernBERT encoder, 2-layer head, scorer, action head); the scorer's last layer is rescaled
so option probabilities are clearly non-uniform and argmax / |dp| comparisons mean something.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile

import torch

log = logging.getLogger(__name__)

SHAPES = {
    # hidden, layers, heads, intermediate, vocab rows, local rope theta, max_len, head_max_len
    "tiny": dict(hidden=128, layers=4, heads=2, ff=192, vocab=None, local_theta=10000.0,
                 max_len=512, head_max_len=192, tok_vocab=4096),
    # shaped like the published multilingual checkpoint (mmBERT-base: local RoPE theta 160000, 1024 tokens,
    # a byte-fallback tokenizer over many scripts, uncalibrated temperatures), at the tiny size
    "tiny-multilingual": dict(hidden=128, layers=4, heads=2, ff=192, vocab=None, local_theta=160000.0,
                              max_len=1024, head_max_len=256, tok_vocab=8192, multilingual=True),
    "mmbert-base": dict(hidden=768, layers=22, heads=12, ff=1152, vocab=256000, local_theta=160000.0,
                        max_len=1024, head_max_len=256, tok_vocab=16384),
    "modernbert-large": dict(hidden=1024, layers=28, heads=16, ff=2624, vocab=50368, local_theta=10000.0,
                             max_len=512, head_max_len=192, tok_vocab=16384),
}
SPECIAL = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
# Temperatures shaped like the published English checkpoint (choice:11+ is clamped to 0.5 on load).
TEMPERATURE = [1.6369, 1.2514, 1.9834]
TEMPERATURE_BY_OPTIONS = {"choice:2": 1.9064, "choice:3-5": 1.7602, "choice:6-10": 1.0,
                          "choice:11+": 0.1006, "score:3-5": 1.2514, "noul:2": 1.9834}

_WORDS = """the of and to in is you that it he was for on are as with his they at be this have from or
one had by word but not what all were we when your can said there use an each which she do how their if
will up other about out many then them these so some her would make like him into time has look two more
write go see number no way could people my than first water been call who oil its now find long down day
did get come made may part customer order refund delivery late broken invoice payment account password
login error crash slow fast urgent angry happy thanks please help support ticket email subject dear regards
price plan upgrade cancel subscription shipping address product quality review spam offer free click link
security risk safe unsafe allowed blocked policy violation route model cheap frontier question answer yes
maybe true false level score choice state json user assistant message turn server database network timeout
bonjour merci commande livraison hallo danke bestellung hola gracias pedido ciao grazie ordine olá obrigado
こんにちは ありがとう 注文 你好 谢谢 订单 привет спасибо заказ مرحبا شكرا طلب नमस्ते धन्यवाद 안녕하세요 감사합니다
""".split()

# Support-desk words per language for the multilingual tokenizer's corpus: every script the published
# multilingual checkpoint reads gets merged pieces, and each script's letters are in the alphabet (_ALPHABETS)
_ML_WORDS = """
en: the order refund delivery late broken invoice payment account password please help thanks customer
fr: bonjour merci commande livraison retard facture paiement compte mot de passe aide client remboursement
de: hallo danke bestellung lieferung rechnung zahlung konto passwort hilfe kunde rückerstattung über später
es: hola gracias pedido entrega factura pago cuenta contraseña ayuda cliente reembolso tarde también
pt: olá obrigado pedido entrega fatura pagamento conta senha ajuda cliente reembolso atrasado não você
it: ciao grazie ordine consegna fattura pagamento conto aiuto cliente rimborso ritardo perché già
nl: hallo bedankt bestelling levering factuur betaling rekening wachtwoord hulp klant terugbetaling
pl: dzień dobry dziękuję zamówienie dostawa faktura płatność konto hasło pomoc klient zwrot spóźnione
tr: merhaba teşekkürler sipariş teslimat fatura ödeme hesap şifre yardım müşteri iade geç değil
vi: xin chào cảm ơn đơn hàng giao hàng hóa đơn thanh toán tài khoản mật khẩu giúp đỡ khách hàng
ru: привет спасибо заказ доставка счёт оплата аккаунт пароль помощь клиент возврат опоздание
uk: привіт дякую замовлення доставка рахунок оплата обліковий пароль допомога клієнт повернення
el: γεια ευχαριστώ παραγγελία παράδοση τιμολόγιο πληρωμή λογαριασμός κωδικός βοήθεια πελάτης επιστροφή
ar: مرحبا شكرا طلب توصيل فاتورة دفع حساب كلمة المرور مساعدة عميل استرداد متأخر
he: שלום תודה הזמנה משלוח חשבונית תשלום חשבון סיסמה עזרה לקוח החזר מאוחר
hi: नमस्ते धन्यवाद ऑर्डर डिलीवरी बिल भुगतान खाता पासवर्ड मदद ग्राहक वापसी देर
bn: নমস্কার ধন্যবাদ অর্ডার ডেলিভারি বিল পেমেন্ট অ্যাকাউন্ট পাসওয়ার্ড সাহায্য গ্রাহক ফেরত দেরি
ta: வணக்கம் நன்றி ஆர்டர் டெலிவரி பில் கட்டணம் கணக்கு கடவுச்சொல் உதவி வாடிக்கையாளர் தாமதம்
th: สวัสดี ขอบคุณ คำสั่งซื้อ การจัดส่ง ใบแจ้งหนี้ การชำระเงิน บัญชี รหัสผ่าน ช่วยเหลือ ลูกค้า คืนเงิน ล่าช้า
ka: გამარჯობა მადლობა შეკვეთა მიწოდება ინვოისი გადახდა ანგარიში პაროლი დახმარება კლიენტი
hy: բարև շնորհակալություն պատվեր առաքում հաշիվ վճարում գաղտնաբառ օգնություն հաճախորդ
am: ሰላም አመሰግናለሁ ትዕዛዝ ማድረስ ደረሰኝ ክፍያ መለያ የይለፍ ቃል እርዳታ ደንበኛ
ja: こんにちは ありがとう 注文 配送 請求書 支払い アカウント パスワード 助けて お客様 返金 遅れ
zh: 你好 谢谢 订单 配送 发票 付款 账户 密码 帮助 客户 退款 延迟 您的 我们
ko: 안녕하세요 감사합니다 주문 배송 청구서 결제 계정 비밀번호 도움 고객 환불 지연
"""
_ML_LEXICON = [line.split(":", 1)[1].split() for line in _ML_WORDS.strip().splitlines()]
# Unicode blocks whose every assigned letter and mark gets a token, beside printable ASCII: Latin-1 / Extended-A,
# Greek, Cyrillic, Armenian, Hebrew, Arabic, Devanagari, Bengali, Tamil, Thai, Georgian, Ethiopic, kana, Hangul jamo
_ALPHABETS = ((0x00C0, 0x024F), (0x0370, 0x052F), (0x0530, 0x058F), (0x0590, 0x06FF), (0x0900, 0x09FF),
              (0x0B80, 0x0BFF), (0x0E00, 0x0E7F), (0x10A0, 0x10FF), (0x1200, 0x137F), (0x3040, 0x30FF),
              (0x3130, 0x318F))
ML_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
# The commonest Han characters and Hangul syllables (whole blocks would outgrow a tiny vocabulary)
_COMMON_CJK = ("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她"
               "里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老"
               "从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机"
               "给等几很业最间新什打便位因重被走电四第门相次东海口使教西再平真听世气信北少关并内加化由却代产入先"
               "山五太水万市眼体别处总才场书比住员九笑性通目报立马命张活难数件安表原车白应路期叫死常提感金何更反"
               "合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风干接它许八特觉望直服毛林题建南度统"
               "色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近"
               "留红治决周保达办运半候七必城父强步完深区即求品士转量空众技轻程告江语英基派满式李息写呢识极令黄德"
               "收脸钱倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似专石若"
               "兵弟谁校读志飞观争究包组造落视济喜离虽坏兴切到还没送货退款订单账户密码帮助客户延迟您이가은는을를"
               "에의고하다서도로한지요세있어니습했것나그수사내우리거기주문배송결제계정비밀번호도움환불지연감안녕"
               "합아직착않았정말왜언제어디무엇누구보내받기다려취소확인부탁드립오늘어제내일시간분후전")


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            words.append(rng.choice(["?", "!", ".", ",", ":", ";", "{", "}", "\"", "-"]))
        s = " ".join(words)
        out.append(s.capitalize() if rng.random() < 0.5 else s)
    return out


def train_tokenizer(seed: int, vocab_size: int):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained deterministically on generated text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def _ml_corpus(seed: int, lines: int = 6000) -> list[str]:
    """Lines of 3-16 words from one or two languages of _ML_LEXICON, with numbers and punctuation."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        langs = rng.sample(_ML_LEXICON, 2) if rng.random() < 0.2 else [rng.choice(_ML_LEXICON)]
        words = [rng.choice(rng.choice(langs)) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            words.append(rng.choice(["?", "!", ".", ",", ":", "؟", "。", "、", "।", "{", "}", "\"", "-"]))
        s = " ".join(words)
        out.append(s.capitalize() if rng.random() < 0.5 else s)
    return out


def train_multilingual_tokenizer(seed: int, vocab_size: int):
    """A SentencePiece-style BPE (metaspace, byte fallback), trained deterministically on _ml_corpus.

    Letters of the _ALPHABETS blocks are single tokens, words of the corpus are merged, and anything else
    (rare CJK, emoji, unlisted scripts) falls back to the 256 byte tokens, so no text maps to `<unk>`.
    """
    import unicodedata

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for lo, hi in _ALPHABETS for c in range(lo, hi + 1)
                                                      if unicodedata.category(chr(c))[0] in "LM"]
    alphabet += sorted(set(_COMMON_CJK))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=ML_SPECIAL, min_frequency=2,
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet) + 1000,
                                  show_progress=False)
    tok.train_from_iterator(_ml_corpus(seed), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first = max(vocab.values()) + 1
    vocab.update({"<0x%02X>" % b: first + b for b in range(256)})
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", pair="<bos> $A <eos> $B <eos>", special_tokens=[("<bos>", bos), ("<eos>", eos)])
    return tok


def _write_json(path: str, obj) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _init_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Seeded random weights: norms near 1 (not exactly, so a mis-loaded norm shows), small matrices."""
    def rand(shape, std):
        return torch.randn(shape, generator=gen) * std

    for name, p in sorted(model.named_parameters()):
        if "norm" in name or name.startswith("scorer.0."):
            p.data.copy_(1.0 + rand(p.shape, 0.1) if name.endswith("weight") else rand(p.shape, 0.02))
        elif name.endswith("bias"):
            p.data.copy_(rand(p.shape, 0.02))
        elif p.dim() == 2 and "embeddings" not in name and "type_emb" not in name:
            # fan-in scaling: every layer changes the residual stream by O(1), so the states at
            # the option markers differ by context and random answers are well conditioned
            p.data.copy_(rand(p.shape, p.shape[1] ** -0.5))
        else:
            p.data.copy_(rand(p.shape, 1.0))


def make_checkpoint(out: str, shape: str = "tiny", seed: int = 0) -> str:
    """Write a complete bundle to `out` and return the path."""
    from transformers import ModernBertConfig, ModernBertModel

    from .network import DecisionModel

    if shape not in SHAPES:
        raise ValueError("unknown shape %r; use one of %s" % (shape, sorted(SHAPES)))
    s = SHAPES[shape]
    os.makedirs(os.path.join(out, "tokenizer"), exist_ok=True)
    os.makedirs(os.path.join(out, "encoder"), exist_ok=True)

    multilingual = bool(s.get("multilingual"))
    if multilingual:
        tok = train_multilingual_tokenizer(seed, s["tok_vocab"])
        names = dict(cls="<bos>", sep="<eos>", pad="<pad>", mask="<mask>", unk="<unk>")
        extra = {"bos_token": "<bos>", "eos_token": "<eos>"}
    else:
        tok = train_tokenizer(seed, s["tok_vocab"])
        names = dict(cls="[CLS]", sep="[SEP]", pad="[PAD]", mask="[MASK]", unk="[UNK]")
        extra = {}
    tok.save(os.path.join(out, "tokenizer", "tokenizer.json"))
    ids = {role: tok.token_to_id(t) for role, t in names.items()}
    special = {"%s_token" % role: t for role, t in names.items()}
    _write_json(os.path.join(out, "tokenizer", "tokenizer_config.json"),
                dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=8192,
                     clean_up_tokenization_spaces=False,
                     **special, **extra))
    _write_json(os.path.join(out, "tokenizer", "special_tokens_map.json"), {**special, **extra})

    vocab = s["vocab"] or ((tok.get_vocab_size() + 63) // 64 * 64)
    layer_types = ["full_attention" if i % 3 == 0 else "sliding_attention" for i in range(s["layers"])]
    ecfg = ModernBertConfig(
        vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["ff"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], max_position_embeddings=8192, local_attention=128, layer_types=layer_types,
        rope_parameters={"full_attention": {"rope_theta": 160000.0, "rope_type": "default"},
                         "sliding_attention": {"rope_theta": s["local_theta"], "rope_type": "default"}},
        pad_token_id=ids["pad"], cls_token_id=ids["cls"], sep_token_id=ids["sep"], bos_token_id=ids["cls"],
        eos_token_id=ids["sep"], architectures=["ModernBertModel"])
    ecfg.save_pretrained(os.path.join(out, "encoder"))

    gen = torch.Generator().manual_seed(seed)
    torch_state = torch.random.get_rng_state()
    enc = ModernBertModel(ecfg)
    model = DecisionModel(enc, head_layers=2, n_act=2).eval()
    torch.random.set_rng_state(torch_state)  # never leave the caller's RNG moved
    _init_(model, gen)
    _scale_scorer(model, tok, ids, gen)

    calibrated = not multilingual   # the published multilingual checkpoint ships [1, 1, 1] and {}
    cfg = {"encoder": "jhu-clsp/mmBERT-base" if multilingual or shape == "mmbert-base"
           else "answerdotai/ModernBERT-large",
           "head_layers": 2, "max_len": s["max_len"], "head_max_len": s["head_max_len"], "max_prefixes": 6,
           "act_costs": {"escalate": 0.5}, "cost_wrong_act": 3.0, "amp_dtype": "bf16", "model_name": "rl-agent",
           "temperature": TEMPERATURE if calibrated else [1.0, 1.0, 1.0],
           "temperature_by_options": TEMPERATURE_BY_OPTIONS if calibrated else {},
           "training": {"generated_by": "laya-fleet make-checkpoint", "shape": shape, "seed": seed}}
    from safetensors.torch import save_file

    sd = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    tmp = os.path.join(out, "model.safetensors.tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(out, "model.safetensors"))
    _write_json(os.path.join(out, "rl_agent_config.json"), cfg)
    return out


@torch.no_grad()
def _scale_scorer(model, tok, ids, gen) -> None:
    """Rescale the scorer's output layer so option logits spread by about 2 (std) on sample rows."""
    rows = []
    for text in _corpus(1234, 32):
        body = tok.encode(text, add_special_tokens=False).ids
        opts = [tok.encode(" option %d %s" % (i, w), add_special_tokens=False).ids
                for i, w in enumerate(text.split()[:5])]
        seq = [ids["cls"]] + tok.encode("choice question: pick", add_special_tokens=False).ids + [ids["sep"]]
        markers = []
        for o in opts:
            markers.append(len(seq))
            seq += [ids["mask"]] + o
        seq += [ids["sep"]] + body + [ids["sep"]]
        rows.append((seq, markers))
    L = max(len(r[0]) for r in rows)
    K = max(len(r[1]) for r in rows)
    inp = torch.full((len(rows), L), ids["pad"], dtype=torch.long)
    att = torch.zeros((len(rows), L), dtype=torch.long)
    mpos = torch.zeros((len(rows), K), dtype=torch.long)
    mmask = torch.zeros((len(rows), K), dtype=torch.bool)
    for i, (seq, markers) in enumerate(rows):
        inp[i, :len(seq)] = torch.tensor(seq)
        att[i, :len(seq)] = 1
        mpos[i, :len(markers)] = torch.tensor(markers)
        mmask[i, :len(markers)] = True
    # Random weights give the marker features a large component shared by every option: removing it from the
    # output weights keeps logits moderate while keeping their spread across options (all a softmax reads)
    h = model.encoder(input_ids=inp, attention_mask=att).last_hidden_state
    h = h + model.type_emb(torch.zeros(len(rows), dtype=torch.long))[:, None, :]
    keep = att.bool()[:, None, None, :]
    for layer in model.head.layers:
        h = layer(h, keep)
    m = torch.gather(h, 1, mpos[:, :, None].expand(-1, -1, h.size(-1)))[mmask]
    feats = model.scorer[:3](m)
    mu = feats.mean(0)
    w = model.scorer[3].weight[0]
    w.sub_(mu * (w @ mu) / (mu @ mu))
    per_row = torch.zeros(mmask.shape)
    per_row[mmask] = feats @ w
    centred = (per_row - per_row.sum(-1, keepdim=True) / mmask.sum(-1, keepdim=True))[mmask]
    spread = float(centred.std())
    if spread > 0:
        w.mul_(2.0 / spread)
    log.info("scorer output scaled by %.3g (row spread %.3g)", 2.0 / max(spread, 1e-12), spread)
    model.scorer[3].bias.fill_(-float((feats @ w).mean()))
