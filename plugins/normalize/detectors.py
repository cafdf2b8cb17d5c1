"""Typed detectors for per-request values in prompt text (dates, times, ids, tokens).

Precision first: a value is reported only when

* a label right before it marks it as current / per-request ("Current time:", "当前时间是",
  "Request ID:", "requestId=", "订单号"; the vocabulary is `labels.py`), and the value has a
  type that fits the label (a time label takes a date, time or epoch — a freshness label
  only one with a time of day; an id label takes a UUID, ULID, JWT, random token or an
  id-like word that is not a count: "Session ID is 128 bits"), or
* it is *bare* but of a type that is per-request by nature (UUID, ULID, JWT; configurable),

and the text does not merely mention it: values in few-shot examples, illustrations,
quotations and code-like calls stay (`mentions.py`). Everything else — versions, prices,
phone numbers, IPs, hex colours, commit hashes, fixed dates ("last updated 2023-11-05") —
has no such label and stays. Text inside code blocks, inline code and embedded tool
definitions is never looked at.

Cost: every value we look for contains an ASCII digit, so one C-level regex pass finds the
digit-bearing tokens and all per-token work (label check, type check) runs only on those.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

from prefixgate.plugins.normalize import labels, mentions

TYPES = ("datetime", "epoch", "uuid", "ulid", "jwt", "token", "id")

WINDOW = 72          # chars before a token searched for its label

# --- value grammars ---------------------------------------------------------------------------
_MON = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
        r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_DOW = (r"(?:Mon(?:day)?|Tue(?:s(?:day)?)?|Wed(?:nesday)?|Thu(?:r(?:s(?:day)?)?)?|Fri(?:day)?"
        r"|Sat(?:urday)?|Sun(?:day)?)")
_TZ = (r"(?:\s?(?:Z|[+-][0-9]{2}:?[0-9]{2}|(?:UTC|GMT)(?:\s?[+-][0-9]{1,2}(?::?[0-9]{2})?)?"
       r"|[ECMP][SD]?T|CES?T|BST|IST|JST|KST|AES?T)(?![A-Za-z])"
       r"|\s?[(（](?:UTC|GMT|[A-Z]{2,4}T|北京时间)[^()（）\n]{0,8}[)）])?")
_TIME = (r"[0-9]{1,2}:[0-9]{2}(?::[0-9]{2}(?:[.,][0-9]{1,9})?)?(?:\s?[AaPp]\.?[Mm]\.?)?" + _TZ)
# a weekday after the date: "2026-03-15 星期日"
_WEEKDAY = r"(?:[ \t]*[（(]?(?:(?:星期|周)[一二三四五六日天]|" + _DOW + r")[)）]?)"
_ISO = r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}" + _WEEKDAY + r"?(?:(?:T|\s)" + _TIME + r")?"
_SLASH = (r"(?:[0-9]{4}/[0-9]{1,2}/[0-9]{1,2}|[0-9]{1,2}/[0-9]{1,2}/[0-9]{2,4}"
          r"|[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{4}|[0-9]{4}\.[0-9]{1,2}\.[0-9]{1,2})"
          r"(?:,?\s" + _TIME + r")?")
_RFC2822 = _DOW + r",?\s+[0-9]{1,2}\s+" + _MON + r"\s+[0-9]{4}(?:\s+" + _TIME + r")?"
_ENG_DATE = (r"(?:" + _DOW + r"\.?,?\s+)?(?:" + _MON + r"\.?\s+[0-9]{1,2}(?:st|nd|rd|th)?,?\s+"
             r"[0-9]{4}|[0-9]{1,2}(?:st|nd|rd|th)?\s+(?:of\s+)?" + _MON + r"\.?,?\s+[0-9]{4})")
_ENG = _ENG_DATE + r"(?:,?\s+(?:at\s+)?" + _TIME + r")?"
_TIME_FIRST = _TIME + r"(?:,?\s+(?:on\s+)?(?:" + _ENG_DATE + r"|[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}))?"
_CN_DOW = r"(?:星期|周)[一二三四五六日天]"
_CN_TIME = (r"(?:上午|下午|晚上|凌晨|中午|早上)?\s*[0-9]{1,2}(?:[:：][0-9]{2}(?:[:：][0-9]{2})?"
            r"|[时点](?:[0-9]{1,2}分(?:[0-9]{1,2}秒)?|半)?)")
_CN = (r"(?:" + _CN_DOW + r"[，,\s]*)?(?:[0-9]{4}年)?[0-9]{1,2}月[0-9]{1,2}[日号]"
       r"(?:[，,]?\s*[（(]?" + _CN_DOW + r"[)）]?)?(?:[，,]?\s*" + _CN_TIME + r")?" + _TZ)

_DATETIME = "|".join(f"(?:{p})" for p in (_CN, _ISO, _RFC2822, _ENG, _SLASH, _TIME_FIRST,
                                          _CN_TIME + _TZ))
_EPOCH = r"[0-9]{10}(?:[0-9]{3})?(?:\.[0-9]{1,6})?"
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_ULID = r"[0-7][0-9A-HJKMNP-TV-Z]{25}"
_JWT = r"eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{8,}"
_TOKEN = r"[0-9a-fA-F]{16,}|[A-Za-z0-9+/_-]{20,}={0,2}"
_ID = r"[A-Za-z0-9][A-Za-z0-9_.:-]{2,127}"

_END = r"(?![A-Za-z0-9])"
TIME_VALUE = re.compile(rf"(?P<datetime>{_DATETIME}){_END}|(?P<epoch>{_EPOCH}){_END}")
ID_VALUE = re.compile(rf"(?P<uuid>{_UUID}){_END}|(?P<jwt>{_JWT}){_END}|(?P<ulid>{_ULID}){_END}"
                      rf"|(?P<token>{_TOKEN}){_END}|(?P<id>{_ID})")
BARE = {"uuid": re.compile(_UUID), "ulid": re.compile(_ULID), "jwt": re.compile(_JWT)}

# A digit-bearing token: starts at a digit (a fast C scan); `scan` gives it the letters before.
# (a comma inside keeps "1,234.50" one token, so an amount's token count does not vary)
_TOKEN_SPLIT = re.compile(r"([0-9](?:[0-9A-Za-z_+/=.:,\-年月日时分秒号]*"
                          r"[0-9A-Za-z=年月日时分秒号])?)")
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_ASCII_LETTERS = frozenset(_LETTERS)
_WORD_CHARS = _LETTERS + "0123456789_-"       # a word holding a token: "req_8f3a", "A1017"
_LEFT = frozenset(_WORD_CHARS)
_HEAD_END = frozenset(_LETTERS + "_-")
_TRIM = ".:-/+_"
_CODE = re.compile(r"```.*?(?:```|\Z)|~~~.*?(?:~~~|\Z)|`[^`\n]+`"
                   r"|<(tools|functions|tool_definitions)>.*?(?:</\1>|\Z)", re.S)
_CODE_MARKS = ("`", "~~~", "<tools>", "<functions>", "<tool_definitions>")
# After a time value, these make it part of a fixed rule or schedule, not "the time now".
_SCHEDULE = re.compile(r"\s*(?:[-–~～至到]\s*[0-9]|前|后|之前|之后|以前|以后|起|开始|截止"
                       r"|(?:before|after|until|till|or later|or earlier|onwards?)\b)", re.I)
_RANGE = re.compile(r"[0-9]{1,2}:[0-9]{2}\s*[-–~～]\s*[0-9]{1,2}:[0-9]{2}$")  # "9:00-18:00"
_CLOCK = re.compile(r"[0-9][:：][0-9]{2}|[0-9]\s*[时点]")         # a time of day in a value
# After an id label, a count or a measure is prose about ids: "is 128 bits", "64-bit".
# After an id label, a count or a measure is prose about ids: "is 128 bits", "16 hex
# characters", "64-bit", "500 以内", not an identifier.
_UNITS = ("bit", "byte", "char", "character", "digit", "letter", "word", "day", "hour", "minute",
          "second", "week", "month", "year")
_UNIT_ADJECTIVES = ("hex", "hexadecimal", "decimal", "numeric", "alphanumeric", "random", "ascii")
_COUNTERS = ("位", "个", "件", "条", "次", "人", "天", "分钟", "小时", "秒", "元", "字",
             "以内", "以上", "以下", "台", "张")
_QUANTITY = re.compile(rf"[0-9]{{1,5}}(?:[ \t]*-?[ \t]*(?:(?:{'|'.join(_UNIT_ADJECTIVES)})[ \t]+)?"
                       rf"(?:{'|'.join(_UNITS)})s?(?![A-Za-z])|[ \t]*(?:{'|'.join(_COUNTERS)}))")
_LINE_HEAD = re.compile(r"\s*(?:[-*•>]\s+|[0-9]{1,2}[.)]\s+)?(?:\*\*|__)?")


@dataclass(slots=True)
class Found:
    """One dynamic value: `start:end` is the value; `cut` the span removed from the text
    (label and all, when the label + value form a clause of their own), else None."""
    start: int
    end: int
    value: str
    label: str
    type: str
    cut: tuple[int, int] | None = None
    at: int = -1             # where the label starts (the value's start when it has none)


def code_spans(text: str) -> list[tuple[int, int]]:
    """Fenced and inline code, and embedded tool definitions: never rewritten.

    Same spans as `_CODE.finditer(text)`, but the regex is tried only where a str.find
    (memchr speed) saw a backtick, `~~~` or a tools tag, instead of at every character."""
    starts = []
    for mark in _CODE_MARKS:
        i = text.find(mark)
        while i >= 0:
            starts.append(i)
            i = text.find(mark, i + 1)
    if not starts:
        return []
    out, pos = [], 0
    for i in sorted(starts):
        if i >= pos:
            m = _CODE.match(text, i)
            if m:
                out.append(m.span())
                pos = m.end()
    return out


def scan(text: str) -> tuple[list[tuple[int, int]], list[str], list[str]]:
    """All digit-bearing words: (spans, the static pieces between them, the words' texts).

    One C-level split finds the tokens, each starting at a digit; the letters right before
    one belong to it ("A1017", "req_8f3a", "e3b0c442-…"). That keeps a value's template the
    same whether it starts with a letter or a digit, so the learner sees one template where a
    hex id or a code varies. `statics` has one piece more than `values`.
    """
    parts = _TOKEN_SPLIT.split(text)
    head_end, word_chars = _HEAD_END, _WORD_CHARS
    for i in range(1, len(parts), 2):
        piece = parts[i - 1]
        if piece and piece[-1] in head_end:
            head = piece[len(piece.rstrip(word_chars)):].lstrip("-_")
            if head:
                parts[i - 1] = piece[:len(piece) - len(head)]
                parts[i] = head + parts[i]
    ends = list(accumulate(map(len, parts)))
    spans = list(zip(ends[0::2], ends[1::2]))
    return spans, parts[0::2], parts[1::2]


def tokens(text: str, code: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans of digit-bearing tokens outside code, in order."""
    return [sp for sp in scan(text)[0] if not (code and _inside_sorted(code, sp[0]))]


def _inside_sorted(code: list[tuple[int, int]], pos: int) -> bool:
    i = bisect_right(code, (pos, 1 << 62)) - 1
    return i >= 0 and pos < code[i][1]


def word_start(text: str, s: int) -> int:
    """Where the word holding the token at `s` starts: "req_8f3a", "e3b0c442-…", "A1017"."""
    while s > 0 and text[s - 1] in _LEFT:
        s -= 1
    while text[s] in "-_":
        s += 1
    return s


class Detector:
    """Compiled detectors for one configuration."""

    def __init__(self, types=TYPES, bare=("uuid", "ulid", "jwt"), time_labels=(), id_labels=(),
                 rules=()):
        self.types = frozenset(types)
        self.bare = [(t, BARE[t]) for t in bare if t in self.types]
        self.label = labels.LabelMatcher(time_labels, id_labels, WINDOW)
        self.gate_words, self.gate_ends = labels.last_words(time_labels, id_labels)
        self.gate_chars = labels.last_chars(time_labels, id_labels)
        self.rules = list(rules)      # [(compiled regex, label)]

    def find(self, text: str, toks: list[tuple[int, int]], code) -> list[Found]:
        """The values to move: `candidates` less those the text only mentions (`mentions`)."""
        return mentions.drop_mentions(text, self.candidates(text, toks, code))

    def candidates(self, text: str, toks: list[tuple[int, int]], code) -> list[Found]:
        """Labelled and bare typed values, then custom rules; sorted, non-overlapping.
        Each depends only on its own line and the WINDOW before it (what `suffix_reuse`
        relies on). The loop runs once per digit-bearing token, so its common path is inline."""
        found: list[Found] = []
        covered = -1
        left, gate_chars, gate_words, gate_ends = _LEFT, self.gate_chars, self.gate_words, \
            self.gate_ends
        letters, bare = _ASCII_LETTERS, self.bare
        for s, e in toks:
            if s < covered or (code and _inside_sorted(code, s)):
                continue
            while s > 0 and text[s - 1] in left:          # "req_8f3a", "e3b0c442-…"
                s -= 1
            while text[s] in "-_":
                s += 1
            if s < covered:
                continue
            # gate: could what precedes the token end a label? (a separator, a bracket, a
            # label's last word or character, or a word a date starts with: "is", "March")
            j = s - 1
            while j >= 0 and text[j] in " \t\n":
                j -= 1
            hit = None
            if j >= 0:
                c = text[j]
                if c in ",，" and j > 0:                   # "Sun, 15 Mar" / "星期日，2026年"
                    j -= 1
                    c = text[j]
                if c in gate_chars:
                    hit = self._labelled(text, s, e)
                elif c in letters:
                    k = j
                    while k >= 0 and text[k] in letters and j - k < 24:
                        k -= 1
                    word = text[k + 1:j + 1].lower()
                    if word in gate_words or word.endswith(gate_ends):
                        hit = self._labelled(text, s, e)
            if hit is None and bare and e - s >= 26:      # the shortest bare type is 26 chars
                hit = self._bare(text, s, e)
            if hit is not None:
                found.append(hit)
                covered = hit.end
        if self.rules:
            found = _merge(found, self._rules(text, code))
        return found

    def _labelled(self, text: str, s: int, e: int) -> Found | None:
        lab = self.label.before(text, s)
        if lab is None:
            return None
        vm = (ID_VALUE if lab.kind == "id" else TIME_VALUE).match(text, lab.value_start)
        if vm is None or vm.lastgroup not in self.types or vm.end() <= s:
            return None
        vs, ve = vm.span()
        while ve > vs and text[ve - 1] in _TRIM:
            ve -= 1
        if lab.kind == "id":
            if vm.lastgroup == "id" and not plausible_id(text, vs, ve):
                return None
        elif _SCHEDULE.match(text, ve) or _RANGE.search(text, vs, ve):
            return None                      # "今天18:00前下单", "now 9:00-18:00": a rule
        elif lab.kind == "fresh" and vm.lastgroup != "epoch" and not _CLOCK.search(text, vs, ve):
            return None                      # "as of 2023-05-01": how documents are dated
        ls = lab.start
        if text[max(0, ls - 4):ls].lower() == "the ":    # "The current date is …" is one clause
            ls -= 4
        return Found(vs, ve, text[vs:ve], lab.text, vm.lastgroup, _clause(text, ls, ve),
                     lab.label_start)

    def _bare(self, text: str, s: int, e: int) -> Found | None:
        for t, rx in self.bare:
            if rx.fullmatch(text, s, e):
                return Found(s, e, text[s:e], context_label(text, s), t, None, s)
        return None

    def _rules(self, text: str, code) -> list[Found]:
        out = []
        for rx, label in self.rules:
            for m in rx.finditer(text):
                g = "value" if "value" in rx.groupindex else 0
                s, e = m.span(g)
                if e > s and not _inside(code, s):
                    cut = _clause(text, m.start(), e) if g == "value" else None
                    out.append(Found(s, e, text[s:e], label or context_label(text, s), "rule",
                                     cut))
        return out


def plausible_id(text: str, vs: int, ve: int) -> bool:
    """An id-like word after an id label is an identifier when it has a digit (a word alone is
    a name) and is no quantity ("Session ID is 128 bits long", "user_id: 64-bit integer")."""
    value = text[vs:ve]
    if not any(c.isdigit() for c in value):
        return False
    quantity = _QUANTITY.match(text, vs)
    return quantity is None or not (value.isdigit() or quantity.end() >= ve)


def _inside(spans, pos) -> bool:
    return any(a <= pos < b for a, b in spans)


def _merge(a: list[Found], b: list[Found]) -> list[Found]:
    out, end = [], -1
    for f in sorted(a + b, key=lambda f: (f.start, -f.end)):
        if f.start >= end:
            out.append(f)
            end = f.end
    return out


def _clause(text: str, ls: int, ve: int) -> tuple[int, int] | None:
    """The span to cut when `label … value` stands on its own: a whole line, or a sentence
    that ends right after the value. None means: replace just the value by a placeholder."""
    line_start = text.rfind("\n", 0, ls) + 1
    line_end = text.find("\n", ve)
    if line_end < 0:
        line_end = len(text)
    head = text[line_start:ls]
    rest = text[ve:line_end].strip()
    if _LINE_HEAD.fullmatch(head) and rest in ("", ".", "。", ",", "，", ";", "；"):
        if line_end < len(text):
            return line_start, line_end + 1
        return (line_start - 1 if line_start > 0 else line_start), line_end
    before = head.rstrip()
    if not before or before[-1] in ".。!！?？;；，":
        if ve == line_end or text[ve:line_end].isspace():
            return ls, ve
        if text[ve] not in "。.;；!！,，":
            return None
        end = ve + 1
        while end < len(text) and text[end] in " \t":
            end += 1
        return ls, end
    return None


def context_label(text: str, pos: int, limit: int = 32) -> str:
    """The words before `pos` on its line (up to `limit` chars): a label for an unlabeled value."""
    line_start = text.rfind("\n", 0, pos) + 1
    head = text[max(line_start, pos - limit):pos]
    for stop in (". ", "。", "! ", "? ", "; ", "；", "：", ": "):
        i = head.rfind(stop)
        if i >= 0 and head[i + len(stop):].strip():
            head = head[i + len(stop):]
    if pos - limit > line_start and " " in head:
        head = head[head.index(" ") + 1:]
    return head.strip(" \t*_-#>:：,，(（[").strip()
