"""What script and language a request's state is written in, for choosing between checkpoints.

`detect(state)` reads the string values of a state (a string, or the values of dicts and lists, keys ignored) and
reports the dominant Unicode script, taken letter by letter from the Unicode character names (unicodedata), and
for Latin-script text the language, from the py3langid classifier restricted to Latin-script languages. Script is
exact; the language of Latin text is a statistical guess, trusted only when the classifier is confident and the
text has enough words. Pure and thread-safe; the classifier's model (4.5 MB, in the wheel) loads on first use.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from typing import Any

# What is read of a state: this many characters of each string value, this many in all, this many values and
# levels; the classifier reads at most LID_CHARS of the whole state and LINE_BUDGET of its lines together
CHAR_BUDGET = 4000
TOTAL_BUDGET = 16000
MAX_LEAVES = 256
MAX_DEPTH = 8
LID_CHARS = 1000
LINE_BUDGET = 4000
# A non-Latin script carries a mostly-Latin state when its words are this share of the letters, or this many
NON_LATIN_SHARE = 0.25
NON_LATIN_LETTERS = 12
# ... and so does one line or value written mostly in non-Latin words, of this many letters or more
LINE_NON_LATIN = 5
# Latin text of MIN_WORDS words or more is English, or another language, when the classifier's top answer has
# MIN_PROBABILITY; of LINE_WORDS words or more, it is not English when English has under NOT_ENGLISH (a line of an
# otherwise English state needs LINE_WORDS words too)
MIN_WORDS = 3
MIN_PROBABILITY = 0.7
LINE_WORDS = 4
NOT_ENGLISH = 0.05
# Latin-script languages py3langid knows ('zxx': no linguistic content); text from other scripts never reaches it
LATIN_LANGUAGES = (
    "af an az br bs ca cs cy da de en eo es et eu fi fo fr fy ga gd gl ha hr ht hu id ig is it jv ku la lb lg ln "
    "lt lv mg ms mt nl nn no oc om pl qu ro rw se sk sl sn so sq sr st sv sw tk tl tr uz vi vo wa xh yo zu zxx").split()

# scripts whose letters' names do not start with the script's usual name
_NAMED = {"CJK": "han", "HIRAGANA": "kana", "KATAKANA": "kana", "HANGUL": "hangul"}
_WORD = re.compile(r"[^\W\d_]+")
# a token that is a link, an address or a joined identifier (user@host, v1.2, a_b, C:\dos) is not prose;
# fixed-width on purpose, so a long token costs linear time
_NOT_PROSE = re.compile(r"://|www\.|@|[^\W_][./\\_][^\W_]")
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")
_ASCII_LETTER = re.compile(r"[A-Za-z]")
_script_cache: dict[str, str] = {}
_model_lock = threading.Lock()
_identifier: Any = None


def script_of(ch: str) -> str | None:
    """The script of one letter ('latin', 'cyrillic', 'han', 'kana', ..., 'other' when unnamed), 'mark' for a
    combining mark, None for anything else (digits, punctuation, modifier letters)."""
    got = _script_cache.get(ch)
    if got is None:
        cat = unicodedata.category(ch)
        name = unicodedata.name(ch, "")
        if cat == "Mn":
            got = "mark"
        elif not ch.isalpha() or cat == "Lm":
            got = ""
        elif not name:
            got = "other"
        else:
            words = name.split(" ")
            first = words[1] if words[0] in ("FULLWIDTH", "HALFWIDTH") else words[0]
            got = _NAMED.get(first, first.lower())
        if len(_script_cache) < 65536:
            _script_cache[ch] = got
    return got or None


def leaves(state: Any) -> list[str]:
    """The string values of `state` in order (dict keys ignored), within the budgets above."""
    out: list[str] = []
    stack = [(state, 0)]
    room = TOTAL_BUDGET
    while stack and len(out) < MAX_LEAVES and room > 0:
        value, depth = stack.pop()
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value[:CHAR_BUDGET]).decode("utf-8", "ignore")
        if isinstance(value, str):
            out.append(value[:min(CHAR_BUDGET, room)])
            room -= len(out[-1])
        elif depth < MAX_DEPTH and isinstance(value, dict):
            stack.extend((v, depth + 1) for v in reversed(list(value.values())))
        elif depth < MAX_DEPTH and isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in reversed(value))
    return out


def script_counts(text: str) -> tuple[dict[str, int], int]:
    """(letters per script, letters in non-Latin words). A non-Latin word is a run of letters of one script that is
    caseless (CJK, Arabic, Devanagari, ...) or lowercase and two letters or more: a capitalised run is a name and
    a lone cased letter a symbol (the α of a formula), neither a sign that the text is written in that script."""
    ascii_letters = len(_ASCII_LETTER.findall(text))
    counts: dict[str, int] = {"latin": ascii_letters} if ascii_letters else {}
    in_words = 0
    for chunk in _NON_ASCII_RUN.findall(text):   # every non-Latin letter is outside ASCII
        runs: list[list[str]] = []
        last = None
        for ch in chunk:
            s = script_of(ch)
            if s == "mark":
                continue
            if s is not None:
                counts[s] = counts.get(s, 0) + 1
                if s != "latin":
                    if s == last:
                        runs[-1].append(ch)
                    else:
                        runs.append([ch])
            last = s
        for run in runs:
            head = run[0]
            if (not head.isupper() and not head.islower()) or (len(run) >= 2 and head.islower()):
                in_words += len(run)
    return counts, in_words


def warm() -> None:
    """Load the classifier now (about 2 s and 120 MB once per process) rather than on the first Latin state."""
    _classifier()


def _classifier():
    global _identifier
    with _model_lock:
        if _identifier is None:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier

            ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
            ident.set_languages(LATIN_LANGUAGES)
            _identifier = ident
    return _identifier


def identify(text: str) -> tuple[str | None, bool | None, int]:
    """(language code or None, whether it is English: True / False / None when undecided, words) for Latin text.

    English needs the classifier's top answer to be English at MIN_PROBABILITY; another language is named at
    that probability too, and text of LINE_WORDS words or more whose English probability is below NOT_ENGLISH
    is not English even when no one language stands out."""
    prose = " ".join(t for t in unicodedata.normalize("NFKC", text[:LID_CHARS]).split() if not _NOT_PROSE.search(t))
    words = [w for w in _WORD.findall(prose) if w.isascii() or all(script_of(ch) in ("latin", "mark") for ch in w)]
    if len(words) < MIN_WORDS:
        return None, None, len(words)
    ranked = _classifier().rank(" ".join(words))
    top, prob = ranked[0]
    if top == "zxx":
        return None, None, len(words)
    if prob >= MIN_PROBABILITY:
        return top, top == "en", len(words)
    if len(words) >= LINE_WORDS and dict(ranked).get("en", 0.0) < NOT_ENGLISH:
        return None, False, len(words)
    return None, None, len(words)


def _accented_share(text: str) -> float:
    """Share of the characters of `text` that are Latin letters outside ASCII (é, ß, ł, ...)."""
    text = unicodedata.normalize("NFKC", text)
    n = sum(1 for chunk in _NON_ASCII_RUN.findall(text) for ch in chunk if script_of(ch) == "latin")
    return n / max(1, len(text))


def detect(state: Any) -> dict:
    """The script and language of `state`: a dict with `script` ('latin', 'cyrillic', ..., 'unknown' when it has
    no letters), `script_profile` (share of letters per script), `language` (a code, or None), `is_english`,
    `language_undecided` (True when nothing says whether Latin text is English), `diacritic_rate` (share of
    non-ASCII Latin letters), `non_latin_fraction` and `mixed_segment` (the line that made otherwise English or
    undecided text non-English, else None)."""
    parts = leaves(state)
    counts: dict[str, int] = {}
    in_words = 0
    for part in parts:
        part_counts, part_words = script_counts(part)
        in_words += part_words
        for k, v in part_counts.items():
            counts[k] = counts.get(k, 0) + v
    letters = sum(counts.values())
    profile = {k: round(v / letters, 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])} if letters else {}
    non_latin = round(1.0 - profile.get("latin", 0.0), 4) if letters else 0.0
    report = {"script": "unknown", "script_profile": profile, "language": None, "is_english": False,
              "language_undecided": True, "diacritic_rate": 0.0, "non_latin_fraction": non_latin,
              "mixed_segment": None}
    if not letters:
        return report
    top = max(counts, key=lambda k: (counts[k], k != "latin"))
    if top != "latin" or in_words >= NON_LATIN_LETTERS or in_words >= NON_LATIN_SHARE * letters:
        report["script"] = top if top != "latin" else max((k for k in counts if k != "latin"), key=counts.get)
        return report
    text = " ".join(parts)
    lang, english, _ = identify(text)
    report.update(script="latin", diacritic_rate=round(_accented_share(text[:CHAR_BUDGET]), 4), language=lang,
                  is_english=english is True, language_undecided=english is None)
    if english is not False:
        found = _foreign_line(parts)
        if found:
            report.update(language=found[0], is_english=False, language_undecided=False, mixed_segment=found[1])
    return report


def _foreign_line(parts: list[str]) -> tuple[str | None, str] | None:
    """(language, line) of the first line of a multi-line state that alone reads as not English or is written in
    non-Latin words, else None (a single line was already read whole)."""
    lines = [line.strip() for part in parts for line in part.splitlines() if line.strip()]
    if len(lines) < 2:
        return None
    room = LINE_BUDGET
    for line in lines:
        if room <= 0:
            break
        room -= len(line)
        counts, in_words = script_counts(line)
        if in_words >= NON_LATIN_LETTERS or in_words >= LINE_NON_LATIN and 2 * in_words > sum(counts.values()):
            return None, line[:200]
        lang, english, words = identify(line)
        if english is False and words >= LINE_WORDS:
            return lang, line[:200]
    return None
