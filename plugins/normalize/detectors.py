"""Typed detectors for per-request values in prompt text (dates, times, ids, tokens).

Precision first: a value is reported only when

* a label right before it marks it as current / per-request ("Current time:", "当前时间是",
  "Request ID:"), and the value has a type that fits the label (a time label takes a date,
  time or epoch; an id label takes a UUID, ULID, JWT, random token or id-like word), or
* it is *bare* but of a type that is per-request by nature (UUID, ULID, JWT; configurable).

Everything else — versions, prices, phone numbers, IPs, hex colours, commit hashes, fixed
dates ("last updated 2023-11-05") — has no such label and stays. Text inside code blocks,
inline code and embedded tool definitions is never looked at.

Cost: every value we look for contains an ASCII digit, so one C-level regex pass finds the
digit-bearing tokens and all per-token work (label check, type check) runs only on those.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from itertools import accumulate
from dataclasses import dataclass

TYPES = ("datetime", "epoch", "uuid", "ulid", "jwt", "token", "id")

# --- labels ---------------------------------------------------------------------------------
# Longer forms first so the regex prefers them. Spaces match any run of spaces, `-` or `_`.
TIME_LABELS = [
    "current date and time", "current date/time", "current datetime", "current date",
    "current utc time", "current local time", "current server time", "current timestamp",
    "current time", "the time now", "time now", "right now", "date and time now",
    "today's date", "todays date", "date today", "today", "now", "timestamp",
    "request time", "request timestamp", "server time", "system time", "local time now",
    "当前日期时间", "当前北京时间", "当前系统时间", "当前时间", "当前日期", "当前时刻", "现在时间",
    "现在的时间", "现在", "今天的日期", "今天", "今日", "系统时间",
    "服务器时间", "请求时间", "时间戳", "此刻",
]
ID_LABELS = [
    "x-request-id", "request id", "requestid", "req id", "trace id", "traceid", "span id",
    "session id", "sessionid", "conversation id", "chat id", "message id", "correlation id",
    "run id", "invocation id", "interaction id", "turn id", "nonce", "idempotency key",
    "请求ID", "请求编号", "请求标识", "会话ID", "会话编号", "会话标识", "对话ID", "追踪ID",
    "跟踪ID", "链路ID", "流水号", "随机数",
]
# The label regex runs only where the text before a token ends in one of these: a separator,
# the last word of a label, or a word a date may start with (label plus month, weekday…).
_MONTHS = ("january february march april may june july august september october november "
           "december jan feb mar apr jun jul aug sep sept oct nov dec")
_DAYS = "monday tuesday wednesday thursday friday saturday sunday mon tue tues wed thu thur fri sat sun"
_GATE_WORDS = frozenset(f"is was {_MONTHS} {_DAYS}".split())
_GATE_CHARS = frozenset(":：=*_)）是为為午上晨间一二三四五六日天")
_ASCII_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
WINDOW = 72          # chars before a token searched for its label

# --- value grammars ---------------------------------------------------------------------------
_MON = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
        r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_DOW = (r"(?:Mon(?:day)?|Tue(?:s(?:day)?)?|Wed(?:nesday)?|Thu(?:r(?:s(?:day)?)?)?|Fri(?:day)?"
        r"|Sat(?:urday)?|Sun(?:day)?)")
_TZ = (r"(?:\s?(?:Z|[+-][0-9]{2}:?[0-9]{2}|(?:UTC|GMT)(?:\s?[+-][0-9]{1,2}(?::?[0-9]{2})?)?"
       r"|[ECMP][SD]T|CES?T|BST|IST|JST|KST|AES?T)(?![A-Za-z])"
       r"|\s?[(（](?:UTC|GMT|[A-Z]{2,4}T|北京时间)[^()（）\n]{0,8}[)）])?")
_TIME = (r"[0-9]{1,2}:[0-9]{2}(?::[0-9]{2}(?:[.,][0-9]{1,9})?)?(?:\s?[AaPp]\.?[Mm]\.?)?" + _TZ)
_ISO = r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}(?:(?:T|\s)" + _TIME + r")?"
_SLASH = (r"(?:[0-9]{4}/[0-9]{1,2}/[0-9]{1,2}|[0-9]{1,2}/[0-9]{1,2}/[0-9]{2,4}"
          r"|[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{4})(?:,?\s" + _TIME + r")?")
_RFC2822 = _DOW + r",?\s+[0-9]{1,2}\s+" + _MON + r"\s+[0-9]{4}(?:\s+" + _TIME + r")?"
_ENG_DATE = (r"(?:" + _DOW + r"\.?,?\s+)?(?:" + _MON + r"\.?\s+[0-9]{1,2}(?:st|nd|rd|th)?,?\s+"
             r"[0-9]{4}|[0-9]{1,2}(?:st|nd|rd|th)?\s+(?:of\s+)?" + _MON + r"\.?,?\s+[0-9]{4})")
_ENG = _ENG_DATE + r"(?:,?\s+(?:at\s+)?" + _TIME + r")?"
_TIME_FIRST = _TIME + r"(?:,?\s+(?:on\s+)?(?:" + _ENG_DATE + r"|[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}))?"
_CN_DOW = r"(?:星期|周)[一二三四五六日天]"
_CN_TIME = (r"(?:上午|下午|晚上|凌晨|中午|早上)?\s*[0-9]{1,2}(?:[:：][0-9]{2}(?:[:：][0-9]{2})?"
            r"|[时点](?:[0-9]{1,2}分(?:[0-9]{1,2}秒)?|半)?)")
_CN = (r"(?:" + _CN_DOW + r"[，,\s]*)?[0-9]{4}年[0-9]{1,2}月[0-9]{1,2}[日号]"
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

# A digit-bearing token: starts at a digit (a fast C scan), extended left in Python.
_TOKEN_SPLIT = re.compile(r"([0-9](?:[0-9A-Za-z_+/=.:\-年月日时分秒号]*[0-9A-Za-z=年月日时分秒号])?)")
_LEFT = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_TRIM = ".:-/+_"
_CODE = re.compile(r"```.*?(?:```|\Z)|~~~.*?(?:~~~|\Z)|`[^`\n]+`"
                   r"|<(tools|functions|tool_definitions)>.*?(?:</\1>|\Z)", re.S)
_CODE_MARKS = ("`", "~~~", "<tools>", "<functions>", "<tool_definitions>")
_SEP = (r"(?P<sep>(?:\s*(?:\([^()\n]{1,24}\)|（[^（）\n]{1,24}）))?\s*(?:\*\*|__)?"
        r"\s*(?:(?:is|was)\b\s*:?|[:：=]|是|为|為)?\s*(?:\*\*|__)?\s*(?:北京时间|本地时间)?)")
_PRE = r"(?P<pre>(?:[A-Za-z]{3,9}\.?,?\s+){0,2}|" + _CN_DOW + r"[，,\s]*|上午|下午|晚上|凌晨|中午|早上)"
# After a time value, these make it part of a fixed rule or schedule, not "the time now".
_SCHEDULE = re.compile(r"\s*(?:[-–~～至到]\s*[0-9]|前|后|之前|之后|以前|以后|起|开始|截止"
                       r"|(?:before|after|until|till|by|or later|or earlier|onwards?)\b)", re.I)
_RANGE = re.compile(r"[0-9]{1,2}:[0-9]{2}\s*[-–~～]\s*[0-9]{1,2}:[0-9]{2}$")  # "9:00-18:00"
_LINE_HEAD = re.compile(r"\s*(?:[-*•>]\s+|[0-9]{1,2}[.)]\s+)?(?:\*\*|__)?")


def _label_alt(labels: list[str]) -> str:
    parts = []
    for lab in sorted(set(labels), key=len, reverse=True):
        parts.append(r"[\s_-]+".join(re.escape(w) for w in lab.split()))
    return "|".join(parts)


def label_regex(time_labels: list[str], id_labels: list[str]) -> re.Pattern:
    """`<label><sep><pre>$`: the window before a value must end with a label and separator."""
    return re.compile(rf"(?<![A-Za-z0-9_])(?:(?P<time>{_label_alt(time_labels)})"
                      rf"|(?P<idl>{_label_alt(id_labels)}))(?![A-Za-z]){_SEP}{_PRE}$", re.I)


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
    """All digit-bearing tokens: (spans, the static pieces between them, the token texts).

    One C-level split does the work; a token starts at a digit, and `Detector.find` extends it
    left over letters where a type needs that. `statics` has one piece more than `values`.
    """
    parts = _TOKEN_SPLIT.split(text)
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
        self.label = label_regex(TIME_LABELS + list(time_labels), ID_LABELS + list(id_labels))
        labels = TIME_LABELS + ID_LABELS + list(time_labels) + list(id_labels)
        self.gate_words = _GATE_WORDS | {re.findall("[a-z]+", lab.lower())[-1] for lab in labels
                                         if re.search("[a-z]$", lab.lower())}
        self.gate_chars = _GATE_CHARS | {lab[-1] for lab in labels if ord(lab[-1]) > 0x2E80}
        self.rules = list(rules)      # [(compiled regex, label)]

    def find(self, text: str, toks: list[tuple[int, int]], code) -> list[Found]:
        """Labelled and bare typed values, then custom rules; sorted, non-overlapping.
        The loop runs once per digit-bearing token, so its common path is kept inline."""
        found: list[Found] = []
        covered = -1
        left, gate_chars, gate_words = _LEFT, self.gate_chars, self.gate_words
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
            # gate: could what precedes the token end a label? (a separator, a label's last
            # word or character, or a word a date starts with: "is", "March", "Tue")
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
                    while k >= 0 and text[k] in letters and j - k < 12:
                        k -= 1
                    if text[k + 1:j + 1].lower() in gate_words:
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
        w0 = max(0, s - WINDOW)
        window = text[w0:s]
        m = self.label.search(window)
        if m is None:
            return None
        vpos = w0 + m.start("pre")
        if m.group("time") is not None:
            label, vm = m.group("time"), TIME_VALUE.match(text, vpos)
        else:
            label, vm = m.group("idl"), ID_VALUE.match(text, vpos)
        if vm is None or vm.lastgroup not in self.types or vm.end() <= s:
            return None
        vs, ve = vm.span()
        while ve > vs and text[ve - 1] in _TRIM:
            ve -= 1
        if m.group("time") is not None and (_SCHEDULE.match(text, ve) or
                                            _RANGE.search(text, vs, ve)):
            return None                      # "今天18:00前下单", "now 9:00-18:00": a rule
        if vm.lastgroup == "id" and not any(c.isdigit() for c in text[vs:ve]):
            return None
        ls = w0 + m.start()
        if text[max(0, ls - 4):ls].lower() == "the ":    # "The current date is …" is one clause
            ls -= 4
        return Found(vs, ve, text[vs:ve], label, vm.lastgroup, _clause(text, ls, ve))

    def _bare(self, text: str, s: int, e: int) -> Found | None:
        for t, rx in self.bare:
            if rx.fullmatch(text, s, e):
                return Found(s, e, text[s:e], context_label(text, s), t)
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
