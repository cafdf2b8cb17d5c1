"""Label spellings and separators, mentions, and the learner's span handling.

Spellings are built here as a cross product — every casing and join people use, every
separator, English and Chinese suffixes — from the label words in ENTITIES_EN and ENTITIES_ZH,
not from the detector's own tables; a spelling the detector lacks fails here with its text.
"""
from __future__ import annotations

import pytest

from prefixgate.common.schema import check
from prefixgate.plugins.normalize.plugin import OPEN, SPEC, Normalizer

ENTITIES_EN = ["request", "session", "conversation", "trace", "span", "correlation", "user",
               "tenant", "device", "order", "build"]
ENTITIES_ZH = ["请求", "会话", "对话", "链路", "用户", "租户", "设备", "订单", "构建"]
ID_VALUE = "7f3a9c2e41b8"


def styles(words: list[str]) -> list[str]:
    """One label in the casings and joins people write: prose, snake, kebab, camel, Pascal,
    SCREAMING_SNAKE, header case, dotted, run together."""
    low = [w.lower() for w in words]
    cap = [w.capitalize() for w in low]
    return [" ".join(cap[:-1] + [low[-1].upper()]), " ".join(low), "_".join(low), "-".join(low),
            low[0] + "".join(cap[1:]), "".join(cap), "".join(cap[:-1]) + low[-1].upper(),
            "_".join(low).upper(), "-".join(cap), ".".join(low), "".join(low)]


LAYOUTS_EN = ["{L}: {v}", "{L}：{v}", "{L}={v}", "{L} = {v}", "{L} {v}", "[{L}] {v}", "[{L}={v}]",
              "({L}: {v})", '"{L}": "{v}"', "{L}=\"{v}\"", "<{L}>{v}</{L}>", "| {L} | {v} |",
              "{L} is {v}.", "**{L}:** {v}", "- {L}: {v}"]
LAYOUTS_ZH = ["{L}：{v}", "{L}: {v}", "{L} {v}", "{L}{v}", "【{L}】{v}", "{L}为{v}。", "{L}是{v}",
              "| {L} | {v} |", "**{L}**：{v}"]


def normalizer() -> Normalizer:
    return Normalizer(check({"learn": False}, SPEC))


def moved(text: str) -> list[str]:
    body = {"messages": [{"role": "system", "content": text + "\nYou are a helpful bot."},
                         {"role": "user", "content": "hi"}]}
    out = [m["value"] for m in normalizer().normalize(body)]
    assert not out or OPEN in body["messages"][-1]["content"]
    return out


def _misses(labels, layouts, value) -> list[str]:
    """The label/layout pairs whose value did not move. A label glued to the value ("{L}{v}")
    only where it ends in a CJK character ("订单号A1017"): "请求ID7f3a" could be one word."""
    return [text for label in labels for layout in layouts
            if not (layout.startswith("{L}{v}") and label[-1].isascii())
            and moved(text := layout.replace("{L}", label).replace("{v}", value)) != [value]]


@pytest.mark.parametrize("entity", ENTITIES_EN)
def test_english_id_labels_in_every_spelling_and_separator(entity):
    labels = styles([entity, "id"]) + [f"{entity.capitalize()} Id",
                                       f"{entity.capitalize()} Identifier"]
    assert _misses(labels, LAYOUTS_EN, ID_VALUE) == []


@pytest.mark.parametrize("entity", ENTITIES_ZH)
def test_chinese_id_labels_with_every_suffix_and_separator(entity):
    labels = [entity + s for s in ("ID", "Id", "id", "编号", "号", " ID", "的编号")]
    assert _misses(labels, LAYOUTS_ZH, ID_VALUE) == []


def test_nonces_and_qualified_labels():
    labels = ["Nonce", "nonce", "NONCE", "cnonce", "随机数", "X-Request-ID", "x-correlation-id",
              "Current Session ID", "parent_span_id", "parentSpanId", "本次请求ID", "当前会话编号"]
    assert _misses(labels, ["{L}: {v}", "{L}={v}", "{L}：{v}"], ID_VALUE) == []


@pytest.mark.parametrize("value", ["2026-03-15 14:22:31", "2026-03-15T14:22:31Z",
                                   "March 15, 2026 2:22 PM", "2026年3月15日 14:22",
                                   "3月15日 14:22"])
def test_time_labels_in_every_spelling(value):
    labels = (styles(["as", "of"]) + styles(["generated", "at"]) + styles(["current", "time"])
              + ["Data as of", "Last updated", "当前时间", "更新于", "数据更新于", "截至",
                 "生成于"])
    layouts = ["{L}: {v}", "{L}：{v}", "{L}={v}", "{L} {v}", "[{L}] {v}", '"{L}": "{v}"',
               "| {L} | {v} |", "**{L}:** {v}"]
    assert _misses(labels, layouts, value) == []


@pytest.mark.parametrize("value", ["2026-03-15", "2026.03.15", "2026/03/15", "15/03/2026",
                                   "March 15, 2026", "Sunday, March 15, 2026", "15 March 2026",
                                   "Sun Mar 15 2026", "Sun, 15 Mar 2026 14:22:31 +0000",
                                   "2:22 PM on March 15, 2026", "14:22 UTC", "2026年3月15日",
                                   "2026年3月15日 星期日 下午2点22分", "3月15日", "14时22分05秒"])
def test_current_time_labels_take_dates_alone_too(value):
    labels = styles(["current", "date"]) + ["Today's date", "Now", "当前日期", "今天的日期"]
    sentences = ["Today is {v}.", "It is now {v}.", "The current date is {v}.", "今天是{v}。",
                 "现在是{v}，", "当前时间为{v}。"]
    assert _misses(labels, ["{L}: {v}", "{L}：{v}", "{L} {v}", "{L}={v}", "| {L} | {v} |"], value) \
        + [s for s in sentences if moved(s.replace("{v}", value)) != [value]] == []


@pytest.mark.parametrize("text,value", [
    ("Generated at 2026-03-15 09:30 by the nightly job.", "2026-03-15 09:30"),
    ("As of 9:05 AM ET, the queue is empty.", "9:05 AM ET"),
    ("当前时间：2026-03-15 星期日 14:22", "2026-03-15 星期日 14:22"),
    ("截至2026年3月15日15时，库存如下：", "2026年3月15日15时"),
    ("Build ID 8812 failed on step 3.", "8812"),                 # a word after it, no unit
    ("The user's ID is u-99812.", "u-99812"),
    ("User Id → 55231", "55231"),
    ("构建编号#20431 失败，请分析日志。", "20431"),
    ('<meta request_id="r-2291" />', "r-2291"),
    ("Tenant: acme | tenant_id: 88213 | plan: gold", "88213"),
    ("当前用户的会员编号是 M20260315001，请称呼其为尊贵会员。", "M20260315001"),
])
def test_labelled_values_in_running_text_move(text, value):
    assert moved(text) == [value]


@pytest.mark.parametrize("text", [
    "Session: s-8842 is the demo account.",             # an entity word alone is no label
    "Acme Desktop 4.12.3 (build 20231105.2)",
    "Order A10293 is the one in the screenshots.",
    "Session IDs are 32 characters long.",
    "The request ID is 16 hex characters long.",
    "user_id: 64-bit integer, never reused.",
    "用户编号为 500 以内的整数时表示测试账号。",
    "订单号为18位数字。",
    "As of 2023-05-01, refunds take 30 days.",          # a freshness label with a date alone
    "This policy was last updated 2023-11-05.",
    "本隐私政策最近更新于2023年11月5日。",
    "API version: 2024-01-01",                           # a version pins, it does not vary
    "Stripe-Version: 2023-10-16",
    "Current time: {current_time}",
    "Orders placed today before 16:00 ship today.",
    "Updated daily at 02:00 UTC.",                       # a schedule, not a stamp
    "数据更新于每天 02:00（北京时间）。",
    "Generated on 2024-02-01 from the product catalogue.",
    "Trace IDs are 32 hex characters; span IDs are 16.",
])
def test_look_alikes_stay(text):
    assert moved(text) == []


# --- mentions --------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "Example:\nUser: my order ID is A10293\nAssistant: It ships tomorrow.",
    "## Examples\n### Refund\nOrder ID: A10293\nRequest ID: req_8f3a2b91c4",
    "<example>\nsession_id: s-77812\n</example>",
    "Here is an example of a good answer:\n\nCustomer: my order ID is A10293.\n\nAgent: Sorry!",
    "Customer: my session ID is s-88213, please check.\nAgent: Thanks, I can see it.",
    "IDs look like this, e.g. Request ID: req_8f3a2b91c4",
    "示例：\n用户：我的订单号是 A10293，帮我查一下。\n客服：好的。",
    "例如：会话ID：s-881234，表示第一次会话。",
    "Reply with \"Request ID: req_8f3a2b91c4\" exactly.",
    "转人工时请以“请求ID：req_8f3a2b91”这样的格式结尾。",
    "lookup(order_id=\"A10293\") returns the order.",
    "NAMESPACE = \"6ba7b810-9dad-11d1-80b4-00c04fd430c8\"",
    "Seed it with uuid.UUID(\"6ba7b810-9dad-11d1-80b4-00c04fd430c8\") first.",
    "| Field | Example |\n|---|---|\n| request_id | req_8f3a2b91c4 |\n| session_id | s-88213 |",
    "For testing, use the sandbox user (User ID: u_test_001).",
    "Examples\n--------\nrequest_id: r-1029\nuser_id: u_7781",
])
def test_mentioned_values_stay(text):
    assert moved(text) == []


@pytest.mark.parametrize("text,value", [
    ("## Examples\nOrder ID: A10293\n## Context\nOrder ID: B22001", "B22001"),
    ("Example:\nOrder ID: A10293\n\nOrder ID: B22001", "B22001"),
    ("<example>\nsession_id: s-77812\n</example>\nSession ID: s-99123", "s-99123"),
    ("Give short answers (for example two lines). Session ID: s-99123", "s-99123"),
    ('{"session_id": "s-99123"}', "s-99123"),            # a JSON field, not a quotation
    ("REQUEST_ID=req_8f3a2b91c4", "req_8f3a2b91c4"),     # an environment variable
    ("User: Alice\nAssistant: Atlas\nUser ID: u_10293", "u_10293"),   # fields, not dialogue
    ("| Field | Value |\n|---|---|\n| Request ID | req_8f3a2b91c4 |", "req_8f3a2b91c4"),
])
def test_live_values_next_to_mentions_still_move(text, value):
    assert moved(text) == [value]


# --- the learner's spans -------------------------------------------------------------------------
def _learn(template: str, rows: list[tuple]) -> list[list[str]]:
    n = Normalizer(check({}, SPEC))
    out = []
    for row in rows:
        body = {"messages": [{"role": "system", "content": template.format(*row)},
                             {"role": "user", "content": "q"}]}
        out.append([m["value"] for m in n.normalize(body)])
    return out


def test_a_span_that_starts_with_a_letter_one_time_and_a_digit_the_next_is_one_slot():
    rows = [("a9f3c2", "C-5"), ("3b1d77", "C-48213"), ("e0aa19", "C-77")]
    assert _learn("Ticket {} for customer {} (plan Pro-3).", rows)[-1] == ["e0aa19", "C-77"]


def test_amounts_with_thousands_separators_keep_their_template():
    rows = [("1,234.50", "7"), ("99.00", "12"), ("12,000.00", "3")]
    assert _learn("余额{}元，积分{}分。客服电话 95588。", rows)[-1] == ["12,000.00", "3分"]
