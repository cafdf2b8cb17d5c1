"""Values a prompt mentions rather than carries: few-shot examples, illustrations, quotations,
code. Their ids and dates are part of the fixed prompt, so they stay where they are.

A typed find (labelled or bare) is dropped when it stands

* in an example block: `<example>…</example>`, `<examples>`, `<sample>`, `<few_shot>`…;
* in an example section: under a markdown heading that names examples ("## Examples",
  "### 示例 2"), up to the next heading that does not;
* in an example paragraph: one opened by an example lead line ("Example:", "Example 2
  (refund):", "For example:", "示例：", "以下是一个例子："), and the dialogue turns that follow
  it ("User: …", "Assistant: …", "用户：…", "客服：…"); or in a transcript, a paragraph with
  both a user's and an assistant's turn;
* in a markdown table whose header row names examples ("| Field | Example |");
* after an example marker in its own clause ("e.g.", "for example", "such as", "例如",
  "格式如", "for testing");
* in a quotation holding label and value ('reply with "Request ID: req_1"'), in a call's
  parentheses ('lookup(order_id="A10293")', 'uuid.UUID("…")'), or assigned to a constant
  (`NAMESPACE = "6ba7b810-…"`).

These look back past the label window (a heading can be far above), which `suffix_reuse`
does not cover, so they run over the whole text after it: `drop_mentions(text, candidates)`.
The cost is paid only by texts that have candidates, and it is local to each find except two
passes for headings and tags.
"""
from __future__ import annotations

import re
from bisect import bisect_right

# --- vocabulary ------------------------------------------------------------------------------
EXAMPLE_WORDS = ("example", "examples", "sample", "samples", "few-shot", "few shot",
                 "demonstration", "demonstrations", "illustration", "demo",
                 "示例", "样例", "范例", "例子", "举例", "示范", "例如", "比如", "范本", "样本")
# Before a label or value in the same clause: what follows illustrates, it is not live data.
INLINE_MARKERS = ("e.g.", "e.g,", "eg.", "eg:", "for example", "for instance", "such as",
                  "looks like", "look like", "something like", "example", "sample", "demo",
                  "for testing", "test user", "test account", "dummy", "placeholder",
                  "例如", "比如", "譬如", "举例", "示例", "样例", "形如", "格式如", "类似", "如：",
                  "测试账号", "测试用户", "演示")
EXAMPLE_TAGS = ("example", "examples", "sample", "samples", "few_shot", "few-shot", "fewshot",
                "demo", "demonstration", "示例", "样例")
USER_TURNS = ("user", "human", "customer", "client", "visitor", "q", "question", "input",
              "用户", "顾客", "客户", "访客", "问", "提问", "输入")
ASSISTANT_TURNS = ("assistant", "ai", "bot", "agent", "model", "a", "answer", "output",
                   "response", "助手", "客服", "机器人", "答", "回答", "输出", "回复")
QUOTES = {'"': '"', "'": "'", "“": "”", "‘": "’", "「": "」", "『": "』"}
QUOTE_REACH = 24             # an opening quote this far before a label can enclose it
CLAUSE_ENDS = re.compile(r"[。！？；;]|[.!?](?=\s|$)")


def _words(words) -> str:
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_DECOR = r"[ \t]*(?:[>*_\-•]+[ \t]*)*"           # markdown around a line's words (headings
                                                 # are sections: `_example_sections`)
_EXAMPLE = rf"(?i:(?<![A-Za-z])(?:{_words(EXAMPLE_WORDS)})(?![A-Za-z]))"
_EXAMPLE_IN = re.compile(_EXAMPLE)
_HEADING = re.compile(r"[ \t]*#{1,6}[ \t]")
_EXAMPLE_HEADING = re.compile(rf"[ \t]*#{{1,6}}[ \t][^\n]*{_EXAMPLE}")
# A short line naming an example and introducing what follows: "Here is an example:",
# "Example 2 (refund):", "以下是两个示例：", or just naming one: "**Sample dialogue**".
_LEAD = re.compile(rf"{_DECOR}(?:[^\n]{{0,48}}{_EXAMPLE}[^\n:：]{{0,32}}[:：]"
                   rf"|(?:[^\n]{{0,16}}[ \t])?{_EXAMPLE}(?:[ \t]+[A-Za-z]+)?[ \t]*"
                   rf"(?:[0-9一二三四五六七八九十]+|[A-Z])?[ \t]*"
                   rf"(?:[(（][^()（）\n]{{0,32}}[)）])?)"
                   rf"[ \t*_]*\Z")
_TURN = re.compile(rf"{_DECOR}(?i:(?P<who>{_words(USER_TURNS + ASSISTANT_TURNS)}))"
                   rf"[ \t]*(?:\*\*)?[ \t]*[:：][ \t]*(?:\*\*)?[ \t]*(?P<said>[^\n]*)")
_ASSISTANT = frozenset(w.lower() for w in ASSISTANT_TURNS)
_TAG_OPEN = re.compile(rf"<(?P<tag>(?i:{_words(EXAMPLE_TAGS)}))(?:[_\- ][^<>\n]*)?>")
_INLINE = re.compile(rf"(?i:(?<![A-Za-z])(?:{_words(INLINE_MARKERS)}))")
_CALL = re.compile(r"[A-Za-z_][\w.]*\([^()\n]*\Z")                 # "lookup(order_id=…"
_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*[ \t]+=[ \t]+[\"']\Z")     # 'NAMESPACE = "…'
MAX_TURN_PARAGRAPHS = 12     # paragraphs of dialogue walked back to find their example lead
REACH = 1500                 # chars either side of a find looked at for its paragraph
LINE_REACH = 240             # chars before a label looked at for a marker, a call, a quote
EXAMINE_PER_KEPT = 4         # typed finds examined per find the caller can use
MAX_TABLE_ROWS = 64          # rows walked up a markdown table to its header


def drop_mentions(text: str, found: list, keep: int | None = None) -> list:
    """`found` less the typed finds that stand in examples, quotations or code; custom rules
    and learned slots are kept (the one is explicit, the other was seen to vary). With
    `keep`, stop once that many are kept (the caller moves no more), and look at no more
    than EXAMINE_PER_KEPT times as many typed finds: a text dense with mentions costs a
    bounded amount, at worst a value past them stays."""
    if not found:
        return found
    budget = None if keep is None else EXAMINE_PER_KEPT * keep
    regions = None
    out = []
    for f in found:
        if keep is not None and (len(out) >= keep or budget <= 0):
            break
        if f.type in ("rule", "learned"):
            out.append(f)
            continue
        if budget is not None:
            budget -= 1
        at = f.at if f.at >= 0 else f.start
        if _local_mention(text, at, f.start, f.end):
            continue
        if regions is None:
            regions = _blocks(text)
        if _inside(regions, at) or _in_example_table(text, at) or _in_example_paragraph(text, at):
            continue
        out.append(f)
    return out


# --- local tests: the find's own line (its last LINE_REACH characters) -------------------------
def _local_mention(text: str, at: int, vs: int, ve: int) -> bool:
    line_start = max(text.rfind("\n", 0, at) + 1, at - LINE_REACH)
    before = text[line_start:at]
    return _after_marker(before) or _quoted(text, at, ve, line_start) or \
        bool(_CALL.search(text, line_start, vs)) or bool(_CONSTANT.search(text, line_start, vs))


def _after_marker(before: str) -> bool:
    """An example marker earlier in the same clause: "(e.g. Request ID: …", "例如订单号…"."""
    last = None
    for match in _INLINE.finditer(before):
        last = match
    return last is not None and not CLAUSE_ENDS.search(before, last.end())


def _quoted(text: str, at: int, ve: int, line_start: int) -> bool:
    """Label and value inside one pair of quotes: a quotation ('reply with "Request ID: …"'),
    not a field ('"id": "…"': its quotes close before the value)."""
    for q in range(at - 1, max(line_start, at - QUOTE_REACH) - 1, -1):
        close = QUOTES.get(text[q])
        if close is not None:
            return ve < len(text) and text[ve] == close and close not in text[q + 1:ve]
    return False


# --- blocks: tags and sections -------------------------------------------------------------
def _blocks(text: str) -> list[tuple[int, int]]:
    """Example tag blocks and example sections, as sorted (start, end) spans."""
    spans = []
    if "<" in text:
        for m in _TAG_OPEN.finditer(text):
            close = text.find(f"</{m.group('tag')}", m.end())
            spans.append((m.start(), close if close >= 0 else len(text)))
    spans += _example_sections(text)
    spans.sort()
    return spans


def _example_sections(text: str) -> list[tuple[int, int]]:
    """From a heading naming examples to the next heading, at its level or above, that does
    not ("## Examples … ### Refund … ## Context": the example section ends at Context)."""
    heads = []                                # (start, level, names an example)
    i = text.find("#")                        # one char: memchr speed ("\n#" is 60x slower)
    while i >= 0:
        end = text.find("\n", i)
        end = len(text) if end < 0 else end
        start = text.rfind("\n", 0, i) + 1
        line = text[start:end]
        if _HEADING.match(line):
            marks = line.lstrip(" \t")
            heads.append((start, len(marks) - len(marks.lstrip("#")),
                          bool(_EXAMPLE_HEADING.match(line))))
        i = text.find("#", end)
    out = []
    for k, (start, level, is_example) in enumerate(heads):
        if is_example and not (out and out[-1][1] > start):
            stop = next((h for h, lv, ex in heads[k + 1:] if lv <= level and not ex), len(text))
            out.append((start, stop))
    return out


def _inside(spans: list[tuple[int, int]], pos: int) -> bool:
    i = bisect_right(spans, (pos, 1 << 62)) - 1
    return i >= 0 and pos < spans[i][1]


# --- tables: a column of examples ------------------------------------------------------------
def _in_example_table(text: str, pos: int) -> bool:
    """In a markdown table whose header row names examples ("| Field | Example |")."""
    line_start = text.rfind("\n", 0, pos) + 1
    if not text.startswith("|", line_start):
        return False
    header = line_start
    for _ in range(MAX_TABLE_ROWS):           # up the table's rows to its header
        above = text.rfind("\n", 0, max(header - 1, 0)) + 1
        if header == 0 or not text.startswith("|", above):
            break
        header = above
    end = text.find("\n", header)
    return bool(_EXAMPLE_IN.search(text, header, len(text) if end < 0 else end))


# --- paragraphs: example leads and dialogue --------------------------------------------------
def _paragraph_start(text: str, pos: int) -> int:
    lo = max(0, pos - REACH)
    i = text.rfind("\n\n", lo, pos)
    return lo if i < 0 else i + 2


def _in_example_paragraph(text: str, pos: int) -> bool:
    """Below an example lead in its paragraph, in a transcript, or in dialogue that follows
    either ("Example 1:\n\nUser: …\n\nAssistant: …"). Paragraphs are taken at most REACH
    characters either side of the find: the cost stays bounded in a text without blank lines."""
    start = _paragraph_start(text, pos)
    heading = text.rfind("\n#", start, pos)          # a heading starts a paragraph too
    if heading >= 0 and _HEADING.match(text, heading + 1):
        start = text.find("\n", heading + 1) + 1
    end = text.find("\n\n", pos, pos + REACH)
    lines = text[start:min(len(text), pos + REACH) if end < 0 else end].split("\n")
    above = text[start:text.rfind("\n", 0, pos) + 1].split("\n")
    if any(_LEAD.match(line) for line in above) or _is_transcript(lines):
        return True
    first = lines[0]
    for _ in range(MAX_TURN_PARAGRAPHS):      # walk back over dialogue to what opened it
        if start < 2 or not (_TURN.match(first) or not first.strip()):
            return False
        end, start = start - 2, _paragraph_start(text, start - 2)
        lines = text[start:end].split("\n")
        if any(_LEAD.match(line) for line in lines) or _is_transcript(lines):
            return True
        first = lines[0]
    return False


def _is_transcript(lines: list[str]) -> bool:
    """A user's turn and an assistant's, each saying something ("User: Alice" is a field)."""
    sides = set()
    for line in lines:
        m = _TURN.match(line)
        if m and _says_something(m.group("said")):
            sides.add(m.group("who").lower() in _ASSISTANT)
    return len(sides) == 2


def _says_something(said: str) -> bool:
    return len(said.split()) >= 3 or sum(ord(c) > 0x2E80 for c in said) >= 4
