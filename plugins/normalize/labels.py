"""The label vocabulary: the words that, right before a value, say it is per request.

Data first: the tables below are all there is to the vocabulary; `LabelMatcher` compiles them
into one regex, which reads the text backwards from a value (one anchored match per value,
not a search through the text before it). A label is

* an *identifier label*: an optional qualifier, an entity word and an id suffix — "Request ID",
  "request_id", "requestId", "X-Request-Id", "trace.id", "parent span id", "请求编号", "订单号" —
  or one of the few words that name a per-request value on their own ("nonce", "流水号");
* a *time label*: a phrase saying the value is the time of this request ("Current time",
  "Today is", "generated at", "当前时间"), or a *freshness label*, saying it is the time of the
  data the prompt carries ("as of", "更新于"). Fixed documents are dated the same way
  ("last updated 2023-11-05", "As of 2023-05-01, refunds take 30 days"), so a freshness label
  takes a value only when it has a time of day; a date alone there is left to the learner.

Words join any way people join them in prose and in code: a space, `_`, `-`, `.`, `/`, "的",
"'s", or nothing (camelCase, "RequestID"), in any casing. Between a label and its value may
stand a note ("(UTC+8)"), brackets or quotes around either ("[Request ID] …",
'"session_id": "…"', "<trace_id>…"), markdown emphasis, and a separator (`:`, `：`, `=`, `→`,
a table's `|`, "is", "是", "为") or just a space.

* an *environment label* (`ENV_FIELDS`, `ENV_BLOCKS`): what coding agents write near the head
  of a prompt about the machine and repository they run in — "Working directory:",
  "Current branch:", "Platform:", "Shell:", `<cwd>…</cwd>`, a "Status:" line followed by
  `git status --short` lines, "Recent commits:" followed by `git log --oneline` lines. These
  stand at the start of a line and their values are mostly digit-free, so `EnvMatcher` reads
  them forwards from each line start instead.

Not labels, on purpose: an entity word alone ("Session: 3 of 5", "build 20231105.2"), versions
("API version: 2024-01-01" pins behaviour; it changes with a release, not a request), and
dates of record ("effective", "valid until", "knowledge cutoff"). A value under such a label
that does change per request is the learner's to find.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# --- identifier labels -------------------------------------------------------------------------
# Things that carry an identifier of their own per request, per conversation or per caller.
# A label names one of them and ends in an ID_SUFFIX. Left out: "account" and "org" (cloud
# account and organisation ids are constants of a deployment), "client" (OAuth client ids).
ID_ENTITIES = {
    "request": ("request", "req", "query", "invocation", "interaction", "call", "请求", "调用"),
    "session": ("session", "sess", "会话"),
    "conversation": ("conversation", "conv", "chat", "dialog", "dialogue", "thread", "turn",
                     "对话", "聊天", "会话轮次"),
    "trace": ("trace", "追踪", "跟踪", "链路", "调用链"),
    "span": ("span",),
    "correlation": ("correlation", "关联"),
    "user": ("user", "customer", "member", "visitor", "用户", "客户", "会员", "访客"),
    "tenant": ("tenant", "workspace", "租户", "空间"),
    "device": ("device", "设备", "终端"),
    "order": ("order", "订单"),
    "build": ("build", "run", "job", "pipeline", "task", "构建", "流水线", "任务"),
    "message": ("message", "msg", "event", "消息", "事件"),
    "transaction": ("transaction", "txn", "payment", "交易", "事务", "支付"),
    "ticket": ("ticket", "case", "incident", "工单", "案件"),
}
ID_SUFFIXES = ("id", "identifier", "uuid", "guid", "key", "hash",            # any casing
               "编号", "号码", "号", "标识", "标识符")
ID_WORDS = ("nonce", "cnonce", "uid", "idempotency key", "traceparent",         # standalone
            "流水号", "随机数", "随机串", "幂等键")
QUALIFIERS = ("current", "parent", "root", "upstream", "original", "active", "this", "your",
              "x", "当前", "本次", "本轮", "父")

# --- time labels -----------------------------------------------------------------------------
TIME_NOW = (
    "current date and time", "current date time", "current datetime", "current date",
    "current time", "current timestamp", "current utc time", "current local time",
    "current server time", "current system time", "date and time now", "time now",
    "the time now", "right now", "now", "utc now", "today's date", "todays date", "date today",
    "today", "timestamp", "request time", "request timestamp", "server time", "system time",
    "local time now", "local time", "generated at", "rendered at",
    "当前日期时间", "当前北京时间", "当前系统时间", "当前时间", "当前日期", "当前时刻", "现在时间",
    "现在的时间", "现在", "今天的日期", "今天", "今日", "系统时间", "服务器时间", "请求时间",
    "时间戳", "此刻", "生成时间", "生成于",
)
TIME_FRESH = (
    "as of", "as at", "data as of", "updated", "updated at", "updated on", "last updated",
    "refreshed at", "last refreshed", "snapshot at", "generated on",
    "更新于", "更新时间", "最后更新", "最近更新", "数据更新时间", "截至", "数据截至",
)

# --- between a label and its value -------------------------------------------------------------
JOIN_CHARS = " \t_./-"                     # between the words of one label, any number of
JOIN_WORDS = ("的", "'s", "’s")             # ... and these: "用户的ID", "user's ID"
OPENERS = "[【(（「『\"'“‘<{`#"             # before a label or a value: "[Request ID]", '"id": "…'
CLOSERS = "]】)）」』\"'”’>}`"
SEPARATORS = (":", "：", "=", "->", "=>", "→", "|", "is", "was", "are", "it is", "it's", "是", "为",
              "為")                        # "|": a markdown table row, "| Request ID | … |"
NOTE_R = r"[)）][^()（）\n]{1,24}[(（]"     # a note, backwards: "Current time (UTC+8): …"
EMPHASIS = r"(?:\*\*|__|\*)"              # markdown around a label or a separator
ZONE_WORDS = ("北京时间", "本地时间")       # "现在是北京时间下午2点30分"

_MON = ("january february march april may june july august september october november "
        "december jan feb mar apr jun jul aug sep sept oct nov dec")
_DAYS = ("monday tuesday wednesday thursday friday saturday sunday "
         "mon tue tues wed thu thur fri sat sun")
# The words a date can start with, before its first digit ("Today is Tuesday, March 15").
DATE_WORDS = frozenset(f"{_MON} {_DAYS}".split())
_PRE_ENDS = "午上晨间一二三四五六日天"      # last characters of a Chinese weekday, time of day



# --- the matcher ---------------------------------------------------------------------------------
# Every pattern below is written backwards: the matcher reads the text from the value back to
# the label. `pre`: the words of a value before its first digit — up to two month or day names
# ("Tuesday, March 15"), a Chinese weekday ("星期日，2026年…") or time of day ("下午2点"). Only
# date words: any word would take a label's own last words for the value's ("Current date and
# time 2026-03-15" read as the label "Current date" and a value "and time 2026-03-15").
_DATE_WORDS_R = "|".join(re.escape(w[::-1]) for w in sorted(DATE_WORDS, key=len, reverse=True))
_PRE_R = (rf"(?P<pre>(?:\s+,?\.?(?i:{_DATE_WORDS_R})(?![A-Za-z])){{0,2}}"
          r"|[，,\s]*[一二三四五六日天](?:期星|周)|午上|午下|上晚|晨凌|午中|上早)")
JOIN = rf"(?:[{re.escape(JOIN_CHARS)}]|{'|'.join(re.escape(w[::-1]) for w in JOIN_WORDS)})*"


def _phrase(label: str) -> str:
    """One label as a pattern, backwards: its words in any casing, joined any way (JOIN)."""
    return JOIN.join(re.escape(w[::-1]) for w in reversed(label.split()))


def _alt(labels) -> str:
    return "|".join(_phrase(lab) for lab in sorted(set(labels), key=len, reverse=True))


def _chars(s: str) -> str:
    return "".join(re.escape(c) for c in s)


def _separator_words() -> str:
    """SEPARATORS backwards; a word one ("is") must be a word of its own ("this" is none)."""
    def word(s: str) -> str:
        if not (s[0].isascii() and s[0].isalpha()):
            return re.escape(s[::-1])
        return rf"(?<![A-Za-z0-9_]){re.escape(s[::-1])}(?![A-Za-z0-9_])"
    return "|".join(word(s) for s in sorted(SEPARATORS, key=len, reverse=True))


def _compile(time_labels, id_labels) -> re.Pattern:
    """`<label><separator><pre>` written backwards, to be matched at the start of the reversed
    text before a value: one anchored match instead of a search through the window.

    Forwards it reads: a word start (or a camelCase hump), an optional opening bracket or
    quote, markdown emphasis, the label (`idl` / `now` / `fresh`: its kind), a separator
    (note, closing bracket, emphasis, separator word, opening bracket, zone word), and `pre`:
    the words of the value before its first digit ("Tuesday, March ")."""
    entities = [w for words in ID_ENTITIES.values() for w in words]
    qualifier = rf"(?:{JOIN}(?:{_alt(QUALIFIERS)}))?"
    idl = (rf"(?P<idl>(?:(?:{_alt(ID_SUFFIXES)}){JOIN}(?:{_alt(entities)})"
           rf"|{_alt(ID_WORDS + tuple(id_labels))}){qualifier})")
    now = rf"(?P<now>{_alt(TIME_NOW + tuple(time_labels))})"
    fresh = rf"(?P<fresh>{_alt(TIME_FRESH)})"
    # The separator is matched atomically (no backtracking into it, which made a failing
    # match cost 2^k retries of the label alternation); a note's ")" is tried before a
    # closing bracket's, so the first reading taken is the right one.
    zones = "|".join(re.escape(z[::-1]) for z in ZONE_WORDS)
    sep = (rf"(?P<sep>(?>(?:{zones})?(?:[ \t]*[{_chars(OPENERS)}])?[ \t]*{EMPHASIS}?[ \t]*:?"
           rf"[ \t]*(?i:{_separator_words()})?[ \t]*{EMPHASIS}?[ \t]*"
           rf"(?:{NOTE_R}|[{_chars(CLOSERS)}](?:[ \t]*{NOTE_R})?)?\s*))")
    # the last character of every label: where none stands (most gated tokens), fail at once
    ends = {p[-1] for p in TIME_NOW + TIME_FRESH + ID_WORDS + ID_SUFFIXES + time_labels + id_labels}
    ends = _chars("".join(sorted(ends | {c.swapcase() for c in ends})))
    end = r"(?:(?<![A-Za-z])|(?![A-Za-z]))"      # a label ending in a letter ends its word
    start = r"(?:(?![A-Za-z0-9])|(?<=[A-Z])(?=[a-z]))"      # a word start or a camelCase hump
    return re.compile(rf"{_PRE_R}{sep}{end}(?=[{ends}])(?P<label>(?i:{idl}|{now}|{fresh}))"
                      rf"{EMPHASIS}?(?P<open>[ \t]*[{_chars(OPENERS)}])?{start}")


@dataclass(slots=True)
class Label:
    """A label found before a value, in the text's own positions."""
    kind: str            # "id", "now" (the time of this request) or "fresh" (of the data)
    text: str            # the label as written: "requestId", "当前时间"
    start: int           # where the label's clause starts (its opening bracket included)
    label_start: int
    value_start: int     # where the value starts: its first word ("Tuesday, March 15")


class LabelMatcher:
    """The vocabulary compiled into one matcher (plus extra phrases from the config, taken as
    whole labels: `time_labels`, `id_labels`)."""

    def __init__(self, time_labels=(), id_labels=(), window: int = 72):
        self.rx = _compile(tuple(time_labels), tuple(id_labels))
        self.window = window

    def before(self, text: str, s: int) -> Label | None:
        """The label that ends right before position `s` (with its separator), if any."""
        w0 = max(0, s - self.window - 1)         # one more char: what precedes the label
        m = self.rx.match(text[w0:s][::-1])
        if m is None:
            return None
        kind = "id" if m.group("idl") is not None else "now" if m.group("now") is not None \
            else "fresh"
        ls, le = s - m.end("label"), s - m.start("label")
        return Label(kind, text[ls:le], s - m.end(), ls, s - m.end("pre"))


def last_words(time_labels=(), id_labels=()) -> tuple[frozenset[str], tuple[str, ...]]:
    """What the letters right before a value can be, for the cheap gate before the matcher
    runs: exactly a label's last ASCII word (or "is", "was", a date word), or ending in a
    label written run-together ("asof", "generatedAt", "requestid") or in its last long word
    (short ones like "at" would gate every "format")."""
    phrases = (TIME_NOW + TIME_FRESH + ID_WORDS + ID_SUFFIXES + tuple(time_labels) +
               tuple(id_labels))
    words = {re.findall("[a-z]+", p.lower())[-1] for p in phrases if re.search("[a-z]$", p.lower())}
    words |= {re.findall("[a-z]+", s)[-1] for s in SEPARATORS
              if s[-1].isascii() and s[-1].isalpha()}
    words |= DATE_WORDS
    ends = {w for w in words if len(w) >= 4 and w not in DATE_WORDS}
    ends |= {re.sub("[^a-z]", "", p.lower()) for p in phrases if p.isascii() and " " in p}
    ends |= {s for s in ID_SUFFIXES if s.isascii()}
    return frozenset(words), tuple(sorted(ends))


def last_chars(time_labels=(), id_labels=()) -> frozenset[str]:
    """Characters that can stand right before a value when a label precedes it: CJK label
    ends, separators, brackets and quotes, markdown emphasis, the end of a Chinese date word."""
    phrases = TIME_NOW + TIME_FRESH + ID_WORDS + ID_SUFFIXES + tuple(time_labels) + tuple(id_labels)
    cjk = {p[-1] for p in phrases if ord(p[-1]) > 0x2E80}
    seps = {s[-1] for s in SEPARATORS if not (s[-1].isascii() and s[-1].isalpha())}
    return frozenset(cjk | seps | set(CLOSERS) | set(OPENERS) | set("*_") | set(_PRE_ENDS)
                     | {z[-1] for z in ZONE_WORDS})


# --- coding agents' environment ------------------------------------------------------------------
# What coding agents write near the head of a prompt about where they run: Claude Code's <env>
# block ("Working directory: …", "Platform: darwin", "OS Version: …") and its gitStatus block,
# Codex's <environment_context> (`<cwd>`, `<shell>`, `<timezone>`), Cline's and Roo's SYSTEM
# INFORMATION ("Default Shell:", "Current Working Directory:"), Aider's platform lines, Gemini
# CLI's "I'm currently working in the directory: …". Each value is one user's or one session's:
# two developers on one tool, or one developer in two checkouts, differ only there. Left in
# place on purpose: settings that steer the agent ("approval_policy", "sandbox_mode",
# "network_access", "Is directory a git repo: Yes") and the repository's main branch (a
# constant of the repository, usually "main").
# A field is `<label>: <value>` at the start of a line (after indentation, a bullet, `**`) or
# `<label>value</label>`; its value must have its kind's shape (detectors.ENV_VALUES), so
# "Platform: web" or "Shell: see below" stay. A path also counts in running text after a path
# label ("… the current working directory: /x", "… the user's workspace is /x").
ENV_FIELDS = {
    "path": ("working directory", "primary working directory", "current working directory",
             "additional working directories", "working directories", "working dir",
             "current workspace directory", "workspace directory", "workspace folder",
             "workspace root", "workspace", "project directory", "project root",
             "repository root", "repo root", "home directory", "current directory", "cwd",
             "pwd", "workdir", "working in the directory", "working in directory",
             "工作目录", "当前工作目录", "当前目录", "项目目录", "项目根目录", "工作区"),
    "branch": ("current branch", "current git branch", "git branch", "active branch", "branch",
               "当前分支", "分支"),
    "os": ("platform", "os version", "operating system", "操作系统"),  # not "OS:" alone: a
    # support bot's "Environment: - OS: macOS 14.4" describes a product, not where it runs
    "shell": ("shell", "default shell", "user shell", "login shell"),
    "timezone": ("timezone", "time zone", "tz", "时区"),
    "person": ("git user", "git user name", "git author", "git 用户"),
}
# A block: its label alone on a line, then one entry per line in its kind's shape, up to the
# first line that has not (git's short status lines; `git log --oneline` lines).
ENV_BLOCKS = {
    "git_status": ("status", "git status", "working tree status", "git 状态"),
    "commits": ("recent commits", "latest commits", "last commits", "最近提交"),
}
ENV_JOIN = r"[ _-]?"                        # "working directory", "working_directory", "workingDir"


def env_key(label: str) -> str:
    """A label's table form: lower case, its words joined by one space ("workingDirectory",
    "WORKING_DIRECTORY" -> "working directory")."""
    spaced = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", label.strip())
    return " ".join(re.split(r"[\s_-]+", spaced.lower()))


def _forward(labels) -> str:
    return "|".join(ENV_JOIN.join(re.escape(w) for w in lab.split())
                    for lab in sorted(set(labels), key=len, reverse=True))


@dataclass(slots=True)
class EnvLabel:
    """An environment label at a line start, in the text's own positions."""
    kind: str            # an ENV_FIELDS or ENV_BLOCKS kind
    text: str            # the label as written: "Working directory", "cwd"
    line_start: int
    label_start: int     # its opening `<` included
    value_start: int
    tag: bool            # `<cwd>…</cwd>`: the value ends at the closing tag


class EnvMatcher:
    """The environment labels compiled into one forward matcher, tried at each line start
    (a newline is a one-character literal the regex engine skips to at C speed)."""

    def __init__(self):
        fields = [lab for labels in ENV_FIELDS.values() for lab in labels]
        blocks = [lab for labels in ENV_BLOCKS.values() for lab in labels]
        self.kinds = {lab: kind for kind, labels in {**ENV_FIELDS, **ENV_BLOCKS}.items()
                      for lab in labels}
        emphasis = r"(?:\*\*|__)?"
        # a line whose first letter starts no label fails at one look, before the alternation
        # (which costs a try per label)
        firsts = {c for lab in fields + blocks for c in (lab[0].lower(), lab[0].upper())}
        gate = f"(?=[<{re.escape(''.join(sorted(firsts)))}])"
        line = (rf"[ \t]*(?:[-*•>][ \t]+)?{emphasis}{gate}"
                rf"(?:<(?P<tag>(?i:{_forward(fields)}))>"
                rf"|(?P<label>(?i:{_forward(fields + blocks)})){emphasis}"
                rf"[ \t]*[:：]{emphasis}[ \t]*)")
        self.line = re.compile("\n" + line)          # every line but the first
        self.first = re.compile(line)
        # a path label right before a path in running text, read backwards from the path
        paths = "|".join(ENV_JOIN.join(re.escape(w[::-1]) for w in reversed(lab.split()))
                         for lab in sorted(ENV_FIELDS["path"], key=len, reverse=True))
        self.path_before = re.compile(
            rf"[ \t]*(?:[\"'(<`][ \t]*)?(?:[:：=][ \t]*|[ \t]+si[ \t]+|[ \t]*)"
            rf"(?P<label>(?i:{paths}))(?![A-Za-z])")

    def labels(self, text: str, end: int):
        """Each environment label on a line starting before `end`, in text order."""
        m = self.first.match(text)
        if m is not None and end > 0:
            yield self._label(m, 0)
        for m in self.line.finditer(text, 0, end):
            yield self._label(m, m.start() + 1)

    def _label(self, m: re.Match, line_start: int) -> EnvLabel | None:
        tag = m.group("tag")
        raw = tag if tag is not None else m.group("label")
        kind = self.kinds.get(env_key(raw))
        if kind is None:
            return None
        group = "tag" if tag is not None else "label"
        return EnvLabel(kind, raw, line_start, m.start(group) - (tag is not None), m.end(),
                        tag is not None)

    def path_label(self, text: str, s: int) -> tuple[int, str] | None:
        """(start, text) of the path label that ends right before position `s`, if any."""
        w0 = max(0, s - 64)
        m = self.path_before.match(text[w0:s][::-1])
        if m is None:
            return None
        ls, le = s - m.end("label"), s - m.start("label")
        if ls > 0 and (text[ls - 1].isalnum() or text[ls - 1] == "_"):
            return None                          # "…sworkspace": inside a word
        return ls, text[ls:le]
