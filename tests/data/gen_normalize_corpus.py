"""Generate `normalize_corpus.yaml`: prompts for the normalize plugin, from a seed.

    python tests/data/gen_normalize_corpus.py              # (re)write the file beside this script
    python tests/data/gen_normalize_corpus.py --check      # exit 1 when the file is stale

Three sections:

* `dynamic`: system prompts (plain, with tool descriptions, with few-shot examples) carrying
  one to three per-request fields. Each field has a `category`, its `value` and an `alt`
  value (the same field as another request would carry it). Everything else in the prompt
  is fixed text, full of look-alikes that must stay.
* `static`: prompts with no per-request value at all, built around a hard case each (`hard`):
  policy dates, version pins, "session" in prose, ids in few-shot examples and tool
  descriptions, code with UUID constants, schedules, quotations.
* `learn`: prompt templates with two to four unlabelled spans that change per request, and
  constants beside them that never do; eight requests each.

The vocabulary here is written the way people write prompts, apart from the detector's own
tables (`plugins/normalize/labels.py`): spellings are listed as people type them, not derived
from the detector, so a spelling the detector lacks shows up as a miss.
"""
from __future__ import annotations

import argparse
import datetime as dt
import random
import string
import sys
from pathlib import Path

import yaml

SEED = 19
N_DYNAMIC = 180
N_STATIC = 180
OUT = Path(__file__).with_name("normalize_corpus.yaml")
HEX = "0123456789abcdef"
B62 = string.ascii_letters + string.digits
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


# --- values --------------------------------------------------------------------------------------
class Values:
    """Per-request values as real systems mint them."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def hex(self, n: int) -> str:
        return "".join(self.rng.choice(HEX) for _ in range(n))

    def digits(self, n: int) -> str:
        lead = str(self.rng.randint(1, 9))       # no leading zero
        return lead + "".join(self.rng.choice(string.digits) for _ in range(n - 1))

    def b62(self, n: int) -> str:
        return "".join(self.rng.choice(B62) for _ in range(n))

    def uuid(self) -> str:
        h = self.hex(32)
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{self.rng.choice('89ab')}{h[17:20]}-{h[20:]}"

    def ulid(self) -> str:
        return self.rng.choice("01") + "".join(self.rng.choice(CROCKFORD) for _ in range(25))

    def moment(self) -> dt.datetime:
        return dt.datetime(2026, 3, 15, 8, 0, 0) + dt.timedelta(
            seconds=self.rng.randint(0, 40 * 86400))


def _id_makers(v: Values) -> dict[str, list]:
    """For each identifier category, the shapes its values come in."""
    r = v.rng
    return {
        "request_id": [lambda: "req_" + v.hex(r.randint(10, 16)),
                       lambda: v.hex(r.choice([16, 20, 32])),
                       v.uuid, lambda: "r-" + v.digits(r.randint(6, 9)), v.ulid,
                       lambda: "req-" + v.b62(12) + v.digits(2)],
        "session_id": [lambda: "sess_" + v.b62(14) + v.digits(2),
                       lambda: "s-" + v.digits(r.randint(5, 9)),
                       v.uuid, lambda: v.hex(24),
                       lambda: f"sess-2026{r.randint(1, 12):02d}{r.randint(1, 28):02d}"
                               f"-{v.digits(4)}"],
        "conversation_id": [lambda: "conv_" + v.hex(r.randint(8, 12)),
                            lambda: "thread_" + v.b62(20) + v.digits(3),
                            v.uuid, lambda: v.digits(r.randint(9, 12))],
        "trace_id": [lambda: v.hex(32), lambda: v.hex(16), v.uuid],
        "span_id": [lambda: v.hex(16)],
        "correlation_id": [v.uuid, lambda: v.hex(20), lambda: "corr-" + v.digits(8)],
        "user_id": [lambda: "u_" + v.digits(r.randint(5, 8)), lambda: v.digits(r.randint(6, 10)),
                    lambda: "usr_" + v.b62(12) + v.digits(2), v.uuid,
                    lambda: "cus_" + v.digits(3) + v.b62(11)],
        "tenant_id": [lambda: "t_" + v.hex(8), lambda: "tenant-" + v.digits(r.randint(4, 6)),
                      v.uuid, lambda: "ws_" + v.digits(2) + v.b62(8)],
        "device_id": [lambda: "dev-" + v.hex(12), lambda: v.uuid().upper(), lambda: v.digits(15),
                      lambda: "AND-" + v.hex(8).upper()],
        "order_id": [lambda: f"ORD-2026-{v.digits(6)}", lambda: v.digits(r.randint(12, 18)),
                     lambda: "A" + v.digits(5), lambda: "SO" + v.digits(10)],
        "build_id": [lambda: v.digits(r.randint(4, 8)),
                     lambda: f"20260{r.randint(3, 4)}{r.randint(10, 28)}.{r.randint(1, 40)}",
                     lambda: "bld-" + v.hex(8), lambda: "gh-" + v.digits(10)],
        "nonce": [lambda: v.hex(r.choice([16, 24, 32])), lambda: v.b62(20) + v.digits(2),
                  lambda: v.b62(10) + "-" + v.digits(3) + v.b62(8)],
    }


# How people write each identifier's label, English and Chinese (not the detector's table).
ID_LABELS = {
    "request_id": (["Request ID", "request_id", "requestId", "RequestID", "X-Request-ID",
                    "x-request-id", "Request-Id", "REQUEST_ID", "request id", "Req ID", "req_id",
                    "reqId", "request.id"],
                   ["请求ID", "请求编号", "请求 ID", "请求id", "本次请求ID", "请求号", "请求的ID"]),
    "session_id": (["Session ID", "session_id", "sessionId", "SessionID", "Session-Id",
                    "SESSION_ID", "session id", "Current session ID", "sessionID"],
                   ["会话ID", "会话编号", "会话 ID", "会话号", "当前会话ID", "会话id"]),
    "conversation_id": (["Conversation ID", "conversation_id", "conversationId", "Conversation-Id",
                         "chat_id", "Chat ID", "thread_id", "Thread ID", "Dialog ID", "conv_id"],
                        ["对话ID", "对话编号", "聊天ID", "对话 ID", "对话的编号"]),
    "trace_id": (["Trace ID", "trace_id", "traceId", "TraceID", "X-Trace-Id", "trace.id",
                  "trace-id", "otel_trace_id"],
                 ["追踪ID", "链路ID", "跟踪编号", "调用链ID", "链路追踪ID"]),
    "span_id": (["Span ID", "span_id", "spanId", "parent_span_id", "Parent Span ID", "span.id",
                 "SpanID"],
                ["Span ID", "spanId"]),
    "correlation_id": (["Correlation ID", "correlation_id", "correlationId", "X-Correlation-ID",
                        "Correlation-Id", "CORRELATION_ID"],
                       ["关联ID", "关联编号"]),
    "user_id": (["User ID", "user_id", "userId", "UserID", "Customer ID", "customer_id",
                 "Member ID", "memberId", "UID", "uid"],
                ["用户ID", "用户编号", "客户编号", "会员号", "用户 ID", "UID", "用户的ID"]),
    "tenant_id": (["Tenant ID", "tenant_id", "tenantId", "TenantID", "Tenant-Id", "workspace_id",
                   "Workspace ID"],
                  ["租户ID", "租户编号", "租户 ID", "空间ID"]),
    "device_id": (["Device ID", "device_id", "deviceId", "DeviceID", "Device-Id"],
                  ["设备ID", "设备号", "设备编号", "终端号", "设备 ID"]),
    "order_id": (["Order ID", "order_id", "orderId", "Order Id", "ORDER_ID"],
                 ["订单号", "订单编号", "订单ID", "订单 ID"]),
    "build_id": (["Build ID", "build_id", "buildId", "Build-Id", "CI build ID", "Pipeline ID",
                  "Job ID", "Run ID", "run_id"],
                 ["构建号", "构建编号", "构建ID", "流水线ID", "任务ID"]),
    "nonce": (["Nonce", "nonce", "NONCE", "cnonce", "Request nonce"],
              ["随机数", "随机串", "Nonce"]),
}

# Time labels as people write them; `clock` says the value carries a time of day.
TIME_LABELS = {
    "current_time": (["Current time", "current_time", "currentTime", "Current date",
                      "Current date and time", "Today's date", "Now", "Timestamp", "timestamp",
                      "Request time", "Server time", "Local time", "CURRENT_DATETIME", "Date today",
                      "current_date"],
                     ["当前时间", "现在时间", "当前日期", "系统时间", "时间戳", "服务器时间",
                      "请求时间", "当前北京时间", "今天的日期"]),
    "as_of": (["Data as of", "Inventory as of", "Balances as of", "Generated at",
               "Report generated at", "Last updated", "Updated at", "Last refreshed",
               "Prices as of", "Updated"],
              ["数据更新于", "更新于", "行情更新于", "截至", "数据截至", "生成时间", "报告生成于",
               "最后更新时间"]),
}
# Sentences that carry the current time ({v}: the value).
TIME_SENTENCES = {
    "current_time": {
        "en": ["Today is {v}.", "It is now {v}.", "The current time is {v}.",
               "The current date is {v}.", "Right now it is {v}."],
        "zh": ["今天是{v}。", "现在是{v}，", "当前时间是{v}。", "当前时间为{v}，",
               "现在是北京时间{v}。"],
    },
    "as_of": {
        "en": ["As of {v}, the figures below are current.",
               "This summary was generated at {v} by the nightly job.",
               "Stock levels updated at {v}; treat older numbers as stale."],
        "zh": ["数据截至{v}，", "以下行情更新于{v}，仅供参考。"],
    },
}


def time_format(v: Values, clock: bool, lang: str, epoch: bool):
    """One of the forms prompts write a date/time in (with a time of day when `clock`), as a
    function of the moment: two requests carry the same form with different moments."""
    with_clock = [
        "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.{ms}+08:00", "%Y-%m-%d %H:%M",
        "%Y/%m/%d %H:%M:%S", "%a, %d %b %Y %H:%M:%S +0000", "%B %-d, %Y %-I:%M %p",
        "%b %-d, %Y, %H:%M UTC", "%-I:%M %p on %B %-d, %Y", "%m/%d/%Y %I:%M %p",
        "%Y-%m-%d %H:%M:%S (UTC+8)", "%H:%M UTC", "%Y-%m-%d %H:%M:%S PST", "%-I:%M %p ET",
        "%Y-%m-%d (%a) %H:%M",
    ]
    with_clock_zh = ["{Y}年{m}月{d}日 %H:%M", "{Y}年%m月%d日 %H:%M:%S", "{Y}年{m}月{d}日 {wd} {cn}",
                     "%H时%M分%S秒", "%Y-%m-%d %H:%M:%S", "{m}月{d}日 %H:%M", "%Y-%m-%d {wd} %H:%M"]
    dates = ["%Y-%m-%d", "%B %-d, %Y", "%A, %B %-d, %Y", "%-d %B %Y", "%d/%m/%Y", "%Y.%m.%d",
             "%a %b %-d %Y"]
    dates_zh = ["{Y}年{m}月{d}日", "{Y}年{m}月{d}日 {wd}", "%Y/%m/%d", "{m}月{d}日", "%Y-%m-%d"]
    if epoch:
        ms = v.rng.random() < 0.4
        return lambda t: str(int(t.timestamp())) + (v.digits(3) if ms else "")
    pool = (with_clock_zh if lang == "zh" else with_clock) * 2
    if not clock:
        pool += dates_zh if lang == "zh" else dates
    form = v.rng.choice(pool)
    return lambda t: t.strftime(form).format(Y=t.year, m=t.month, d=t.day, wd=_cn_weekday(t),
                                             cn=_cn_clock(t), ms=v.digits(3))


def _cn_weekday(t: dt.datetime) -> str:
    return "星期" + "一二三四五六日"[t.weekday()]


def _cn_clock(t: dt.datetime) -> str:
    half = "上午" if t.hour < 12 else "下午"
    h = t.hour if t.hour <= 12 else t.hour - 12
    return f"{half}{h}点{t.minute:02d}分"


# --- fixed text ----------------------------------------------------------------------------------
PERSONAS = {
    "en": ["You are Atlas, the support assistant for Northwind Cloud.",
           "You are a careful code-review bot for the payments team.",
           "You are Mira, a travel concierge for a boutique hotel chain.",
           "You are the on-call SRE copilot for a Kubernetes platform.",
           "You help shoppers of an online furniture store track and change their orders.",
           "You are a tax-filing helper for freelancers.",
           "You are an internal HR assistant. Answer questions about leave and benefits.",
           "You are a tutor for high-school chemistry.",
           "You summarise CI logs for developers and point at the failing step."],
    "zh": ["你是一个电商平台的智能客服。", "你是某银行的在线理财顾问。",
           "你是一名耐心的中学数学老师。", "你是物流公司的查询助手，帮助用户追踪包裹。",
           "你是企业内部的IT服务台助手。",
           "你是一家连锁酒店的预订助手。", "你是运维平台的告警分析助手。", "你是医院的导诊助手。"],
}


def fillers(rng: random.Random, lang: str) -> list[str]:
    """Fixed rules full of look-alikes: versions, prices, phones, hosts, fixed dates, schedules."""
    y, m, d = rng.randint(2019, 2025), rng.randint(1, 12), rng.randint(1, 28)
    n = rng.randint
    if lang == "zh":
        return [
            f"客服电话 400-{n(100, 999)}-{n(1000, 9999)}，工作时间 {n(8, 9)}:00-{n(17, 21)}:00。",
            f"退货政策：自{y}年{m}月{d}日起，签收后{n(7, 15)}天内可无理由退货。",
            f"本规范最近更新于{y}年{m}月{d}日。",
            f"会员价 {n(99, 999)} 元，满 {n(100, 300)} 元包邮。",
            f"接口版本：{y}-{m:02d}-{d:02d}，请勿调用已废弃的 v{n(1, 3)} 接口。",
            f"会话ID由{rng.choice([16, 24, 32])}位十六进制字符组成，不要向用户展示。",
            f"每个会话最长 {n(20, 60)} 分钟。",
            f"订单号为{n(12, 18)}位数字，请在回复中完整引用。",
            f"今天{n(15, 18)}:00前下单，当日发货。",
            f"内网网关 192.168.{n(0, 9)}.{n(1, 254)}，禁止透露给用户。",
            f"生效日期：{y}-{m:02d}-{d:02d}。",
            f"你的知识截止到{y}年{m}月。",
            f"单笔转账限额 {n(2, 9)}0000 元/日，超过需人工审核。",
            f"回答不超过 {n(100, 400)} 字，金额保留两位小数，例如 {n(10, 99)}.50 元。",
            f"系统版本 HarmonyOS {n(3, 5)}.{n(0, 2)}.0.{n(100, 200)}。",
        ]
    return [
        f"Plans: Basic ${n(5, 19)}.99/month, Pro ${n(20, 90)}.00/month (billed yearly).",
        f"Support line: +1 (415) 555-{n(1000, 9999)}; never give out personal numbers.",
        f"The public API is v{n(1, 4)}.{n(0, 20)}.{n(0, 9)}; "
        f"clients older than build {n(1000, 9999)} must upgrade.",
        f"Escalate refunds above ${n(100, 5000)} to a human agent.",
        f"Never reveal internal hosts such as db-{n(1, 40):02d}.internal or "
        f"10.{n(0, 255)}.{n(0, 255)}.{n(1, 254)}.",
        f"Refund policy (effective {y}-{m:02d}-{d:02d}): "
        f"refunds within {n(14, 60)} days of purchase.",
        f"This document was last updated {y}-{m:02d}-{d:02d}.",
        f"As of {y}-{m:02d}-{d:02d}, the warranty covers {n(6, 36)} months.",
        f"API version: {y}-{m:02d}-{d:02d}. Send it in every call.",
        f"Each session lasts {n(20, 60)} minutes; "
        f"a user may open at most {n(2, 5)} sessions a day.",
        f"Session IDs are {rng.choice([16, 24, 32])} characters long and never shown to users.",
        f"Order numbers look like ORD-{y}-{n(100000, 999999)}.",
        f"Business hours: {n(8, 9)}:00-{n(17, 19)}:00, Monday to Friday.",
        f"Orders placed today before {n(2, 5)} PM ship the same day.",
        f"Brand colour #{''.join(rng.choice(HEX) for _ in range(6)).upper()}; "
        "body text rgba(0, 0, 0, 0.87).",
        f"Knowledge cutoff: {y}-{m:02d}.",
        f"The regression was fixed in commit {''.join(rng.choice(HEX) for _ in range(40))} "
        f"(PR #{n(100, 9999)}).",
        f"Use metric units (1 km = 1000 m) and round to {n(1, 3)} decimals.",
        f"The request timeout is {n(10, 60)} s and the retry budget is {n(2, 5)} per user.",
        f"Python {n(3, 3)}.{n(9, 12)} and Node {n(18, 22)}.{n(0, 11)}.1 are supported.",
    ]


def tool_section(rng: random.Random, lang: str, v: Values) -> str:
    """Tools described in the prompt, with example ids that are part of the fixed text."""
    oid, uid = f"ORD-2024-{v.digits(6)}", v.uuid()
    forms_en = [
        f"You can call these tools:\n"
        f"- lookup_order(order_id): fetch an order, e.g. order_id=\"{oid}\".\n"
        f"- refund(order_id, amount): amounts in USD, at most $500.00.",
        f"Tools:\n<tools>\n{{\"name\": \"get_session\", \"parameters\": "
        f"{{\"session_id\": {{\"type\": \"string\", "
        f"\"example\": \"{uid}\"}}}}}}\n</tools>\nCall a tool only when needed.",
        f"## Tools\n`search_tickets(query, limit=20)` searches tickets; "
        f"`get_user(user_id)` returns a profile (user ids look like u_{v.digits(6)}).",
        f"Available function: create_invoice(customer_id, due_date). Example call: "
        f"create_invoice(customer_id=\"cus_{v.digits(4)}\", due_date=\"2024-07-01\").",
        f"get_trace(trace_id: str) -> Trace\n    trace_id: 32 hex chars, e.g. {v.hex(32)}",
        f"Parameters of cancel_order: order_id (string, required), for instance {oid}; "
        f"reason (string).",
    ]
    forms_zh = [
        f"可用工具：\n- query_order(order_id)：查询订单，例如 order_id=\"{oid}\"。\n"
        f"- cancel_order(order_id)：取消订单。",
        f"工具定义：\n<tools>\n{{\"name\": \"get_device\", \"parameters\": "
        f"{{\"device_id\": {{\"example\": \"{uid}\"}}}}}}\n</tools>",
        f"调用 `get_user(user_id)` 获取用户资料，用户编号形如 u_{v.digits(6)}。",
        f"函数 query_device(device_id)：设备号，比如 DEV-{v.hex(8).upper()}。",
    ]
    return rng.choice(forms_zh if lang == "zh" else forms_en)


def fewshot_section(rng: random.Random, lang: str, v: Values) -> str:
    """Few-shot examples whose ids and dates are part of the fixed prompt."""
    oid, sid, t = "A" + v.digits(5), "s-" + v.digits(6), "2024-05-01 09:30:00"
    forms_en = [
        f"Example:\nUser: Where is my order? Order ID: {oid}\n"
        f"Assistant: Order {oid} left our warehouse yesterday.",
        f"## Examples\n\n### Example 1\nCurrent time: {t}\nSession ID: {sid}\n"
        f"User: Can I still cancel?\nAssistant: Yes, until 18:00 today.",
        f"<example>\nRequest ID: req_{v.hex(10)}\nUser: reset my password\n"
        f"Assistant: I have sent a reset link.\n</example>",
        f"Here is an example of a good answer:\n\n"
        f"Customer: my order ID is {oid}, it never arrived.\n\n"
        f"Agent: I am sorry! I have opened a trace for order {oid}.",
        f"Sample dialogue\nQ: What is my user ID? (it is u_{v.digits(5)})\n"
        f"A: Your user ID is shown under Settings.",
        f"Example 2 (escalation):\n"
        f"Input: {{\"request_id\": \"req_{v.hex(10)}\", \"tenant_id\": \"t_{v.hex(8)}\"}}\n"
        f"Output: escalate to tier 2",
        f"### Examples\n- Today is {t[:10]}. User asks for a refund on order ID {oid} -> approve.\n"
        f"- Device ID: dev-{v.hex(12)} reports offline -> ask for a restart.",
        f"For example, if the trace ID is {v.hex(32)}, link to the trace view.",
    ]
    forms_zh = [
        f"示例：\n用户：我的订单号是 {oid}，帮我查一下。\n客服：好的，订单 {oid} 已于昨天发出。",
        f"## 示例\n当前时间：{t}\n会话ID：{sid}\n用户：还能退货吗？\n"
        f"助手：可以，签收后7天内都可以。",
        f"以下是一个例子：\n\n用户：请求ID是 req_{v.hex(10)}，接口报错了。\n\n"
        f"客服：收到，我们会根据该请求ID排查。",
        f"示例对话：\n顾客：设备号 DEV-{v.hex(6).upper()} 连不上网。\n客服：请先重启设备。",
        f"例如：会话ID：s-{v.digits(6)}，表示该用户的第一次会话。",
    ]
    return rng.choice(forms_zh if lang == "zh" else forms_en)


# --- dynamic prompts -----------------------------------------------------------------------------
def _key(label: str) -> str:
    """A label written as a key: "Request ID" -> request_id; a key stays as it is."""
    return label if " " not in label else "_".join(label.lower().split())


def field_text(rng: random.Random, lang: str, label: str, slot: str, category: str) -> str:
    """One field in one of the layouts prompts use; `slot` stands for the value."""
    zh_label = any(ord(c) > 0x2E80 for c in label)
    seps = ["：", "：", ": ", " "] if zh_label else [": ", ": ", "=", " = ", " ", ":"]
    sep = rng.choice(seps)
    layouts = [f"{label}{sep}{slot}", f"- {label}: {slot}", f"* {label}{sep}{slot}",
               f"**{label}:** {slot}", f"**{label}**: {slot}", f"[{label}: {slot}]",
               f"| {label} | {slot} |"]
    if zh_label:
        layouts += [f"【{label}】{slot}", f"{label}为{slot}。", f"{label}是 {slot}"]
    else:
        key = _key(label)
        layouts += [f"[{key}={slot}]", f"<{key}>{slot}</{key}>", f"{{\"{key}\": \"{slot}\"}}",
                    f"{key}=\"{slot}\"", f"(`{key}`: {slot})"]
        if category not in ("current_time", "as_of") and not label.lower().startswith("current"):
            layouts += [f"Your {label} is {slot}.", f"The current {label} is {slot}.",
                        f"{label} → {slot}"]
        noun = category.split("_")[0]
        if category.endswith("_id") and noun not in ("span", "correlation"):
            layouts.append(f"The {noun}'s ID is {slot}.")
    text = rng.choice(layouts)
    return text


def dynamic_prompt(rng: random.Random, v: Values, k: int) -> dict:
    lang = rng.choice(["en", "zh", "mixed"])
    persona_lang = "zh" if lang == "zh" or (lang == "mixed" and rng.random() < 0.5) else "en"
    label_lang = persona_lang if lang != "mixed" else ("en" if persona_lang == "zh" else "zh")
    kind = rng.choice(["system", "system", "tools", "fewshot"])
    makers = _id_makers(v)
    categories = list(ID_LABELS) + ["current_time", "current_time", "as_of", "bare"]
    chosen = rng.sample(categories, rng.randint(1, 3))
    fields, lines = [], []
    for i, cat in enumerate(chosen):
        slot = f"\x00{i}\x00"              # filled in below (the text has braces of its own)
        li = 0 if label_lang == "en" else 1
        if cat in ID_LABELS:
            label = rng.choice(ID_LABELS[cat][li])
            make = rng.choice(makers[cat])
            vals = (make(), make())
            lines.append(field_text(rng, label_lang, label, slot, cat))
        elif cat == "bare":
            make = rng.choice([v.uuid, v.ulid])
            vals = (make(), make())
            lines.append(rng.choice([f"You are assisting in conversation {slot}.",
                                     f"Attached upload {slot} is private.",
                                     f"本次对话关联 {slot}。", f"Context blob {slot} follows."]))
        else:
            clock = cat == "as_of"
            if rng.random() < 0.3:
                sentence = rng.choice(TIME_SENTENCES[cat][label_lang])
                form = time_format(v, clock, label_lang, False)
                vals = (form(v.moment()), form(v.moment()))
                lines.append(sentence.replace("{v}", slot))
            else:
                label = rng.choice(TIME_LABELS[cat][li])
                epoch = label.lower() in ("timestamp", "时间戳")
                form = time_format(v, clock, label_lang, epoch)
                vals = (form(v.moment()), form(v.moment()))
                lines.append(field_text(rng, label_lang, label, slot, cat))
        fields.append({"category": cat, "value": vals[0], "alt": vals[1]})
    persona = rng.choice(PERSONAS[persona_lang])
    rules = rng.sample(fillers(rng, persona_lang), rng.randint(2, 5))
    extra = {"tools": lambda: tool_section(rng, persona_lang, v),
             "fewshot": lambda: fewshot_section(rng, persona_lang, v)}.get(kind, lambda: "")()
    # a prompt that titles its examples with a markdown heading titles its context too
    block = _context_block(rng, persona_lang, lines, markdown=extra.startswith("#"))
    where = rng.choice(["head", "head", "after_persona", "tail"])
    parts = {"head": [block, persona, " ".join(rules), extra],
             "after_persona": [persona, block, " ".join(rules), extra],
             "tail": [persona, " ".join(rules), extra, block]}[where]
    template = "\n\n".join(p for p in parts if p)
    text, alt = template, template
    for i, f in enumerate(fields):
        text, alt = text.replace(f"\x00{i}\x00", f["value"]), alt.replace(f"\x00{i}\x00", f["alt"])
    return {"id": f"dyn-{k:03d}-{lang}-{kind}", "lang": lang, "kind": kind, "text": text,
            "alt_text": alt, "fields": fields}


def _context_block(rng: random.Random, lang: str, lines: list[str], markdown: bool) -> str:
    body = "\n".join(lines)
    heads = (["## 当前会话", "【上下文】", "系统信息：", ""] if lang == "zh"
             else ["## Context", "Session context:", "<context>", "Metadata", ""])
    head = rng.choice(heads) if not markdown else heads[0]
    if head == "<context>":
        return f"<context>\n{body}\n</context>"
    return f"{head}\n{body}" if head else body


# --- static prompts ------------------------------------------------------------------------------
def static_prompt(rng: random.Random, v: Values, k: int) -> dict:
    lang = rng.choice(["en", "zh", "mixed"])
    plang = "zh" if lang == "zh" or (lang == "mixed" and rng.random() < 0.5) else "en"
    cases = [rng.choice(HARD_CASES)(rng, v, plang if lang != "mixed" else rng.choice(["en", "zh"]))
             for _ in range(rng.choice([1, 1, 2]))]
    persona = rng.choice(PERSONAS[plang])
    rules = rng.sample(fillers(rng, plang), rng.randint(1, 4))
    parts = [persona, " ".join(rules)]
    for _, text in cases:
        parts.insert(rng.randint(1, len(parts)), text)
    hard = cases[0][0]
    return {"id": f"static-{k:03d}-{lang}-{hard}", "lang": lang,
            "hard": [c[0] for c in cases], "text": "\n\n".join(parts)}


def _policy(rng, v, lang):
    y, m, d = rng.randint(2019, 2025), rng.randint(1, 12), rng.randint(1, 28)
    en = [f"Refund policy, effective {y}-{m:02d}-{d:02d}: refunds within 30 days.",
          f"As of {y}-{m:02d}-{d:02d}, premium support is included in every plan.",
          f"Terms of service (last updated {dt.date(y, m, d):%B %-d, %Y}). "
          f"Version {rng.randint(2, 9)}.",
          f"The promotion is valid from {y}-{m:02d}-01 until {y}-{m:02d}-{d:02d}.",
          f"Our privacy notice was updated on {y}-{m:02d}-{d:02d} to cover the EU AI Act.",
          f"Pricing below is as of {dt.date(y, m, d):%-d %B %Y} and excludes VAT.",
          f"Prices are valid until {y + 1}-12-31.", f"Effective date: {y}-{m:02d}-01",
          f"Revised: {dt.date(y, m, d):%B %-d, %Y}. Supersedes all earlier versions.",
          f"The SLA (v3, signed {y}-{m:02d}-{d:02d}) guarantees 99.9% monthly uptime."]
    zh = [f"本隐私政策自{y}年{m}月{d}日起生效，最近更新于{y}年{m}月{d}日。",
          f"生效日期：{y}-{m:02d}-{d:02d}。本规则解释权归平台所有。",
          f"活动时间：{y}年{m}月1日至{y}年{m}月{d}日。",
          f"截至{y}年底，累计服务用户超过{rng.randint(2, 90)}00万。",
          f"资费标准更新于{y}年{m}月{d}日，详见官网。",
          f"本活动最终解释权归本公司所有，有效期至{y + 1}年12月31日。",
          f"修订日期：{y}年{m}月{d}日"]
    return "policy_date", rng.choice(zh if lang == "zh" else en)


def _versions(rng, v, lang):
    y, m, d = rng.randint(2022, 2025), rng.randint(1, 12), rng.randint(1, 28)
    en = [f"API version: {y}-{m:02d}-{d:02d}",
          f"Send the header Stripe-Version: {y}-{m:02d}-{d:02d} with every request.",
          f"Schema version = {y}-{m:02d}-{d:02d}; older schemas are rejected.",
          f"Acme Desktop {rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)} "
          f"(build {y}{m:02d}{d:02d}.{rng.randint(1, 9)})",
          f"Model: gpt-4o-{y}-{m:02d}-{d:02d}; fall back to llama-3.1-8b.",
          f"Always send anthropic-version: {y}-{m:02d}-{d:02d} "
          f"and X-API-Version: {rng.randint(2, 9)}.",
          f"apiVersion: {y}-{m:02d}-{d:02d}\nkind: Deployment",
          f"OpenAPI spec {rng.randint(2, 3)}.{rng.randint(0, 1)}.0, info.version {y}.{m}.{d}"]
    zh = [f"接口版本：{y}-{m:02d}-{d:02d}",
          f"当前客户端版本 {rng.randint(1, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 99)}"
          f"（构建 {y}{m:02d}{d:02d}）。",
          f"协议版本号 v{rng.randint(1, 5)}.{rng.randint(0, 9)}，发布于{y}年{m}月。",
          f"模型版本：{y}-{m:02d}-{d:02d}，请勿自行升级。"]
    return "version_pin", rng.choice(zh if lang == "zh" else en)


def _prose_words(rng, v, lang):
    n = rng.randint(2, 64)
    en = [f"Each session lasts {n} minutes. "
          f"Sessions expire after {rng.randint(2, 24)} hours of inactivity.",
          f"The session ID is {rng.choice([64, 128])} bits long "
          f"and rotates every {rng.randint(2, 48)} hours.",
          f"A request ID is {rng.choice([16, 20, 32])} hex characters; quote it when you escalate.",
          f"Traces are sampled at {rng.randint(1, 20)}% "
          f"and a trace keeps at most {rng.randint(64, 512)} spans.",
          f"user_id: 64-bit integer, never reused. "
          f"tenant_id: string, at most {rng.randint(16, 64)} characters.",
          f"Order ID format: ORD-YYYY-NNNNNN "
          f"(for instance ORD-{rng.randint(2019, 2024)}-{v.digits(6)}).",
          f"If the user gives a session number (1-{rng.randint(5, 12)}), "
          f"confirm it before continuing.",
          "Device IDs start with dev- and build IDs are plain integers.",
          f"Session {rng.randint(2, 9)} of the course covers recursion; "
          f"session {rng.randint(10, 14)} is the exam.",
          f"In our examples user {rng.randint(2, 9)} is an admin "
          f"and tenant {rng.randint(10, 99)} is a sandbox.",
          f"A build takes about {rng.randint(5, 40)} minutes; "
          f"keep the last {rng.randint(3, 20)} builds.",
          f"The order ID is {rng.randint(12, 18)} digits; the trace ID is 32 hex digits."]
    zh = [f"会话ID由{rng.choice([16, 32])}位十六进制字符组成，请勿向用户展示。",
          f"每次会话最长 {n} 分钟，超时后需重新登录。",
          f"订单号为{rng.randint(12, 18)}位数字，格式如 {v.digits(16)}。",
          f"用户编号为 {rng.randint(100, 999)} 以内的整数时表示内部测试账号。",
          f"请求ID长度为{rng.choice([16, 32])}位，排查问题时请提供。",
          f"设备号一般印在机身背面，共{rng.randint(12, 16)}位。",
          f"第{rng.randint(2, 9)}次会话开始前，请先复习上一次的内容。",
          f"每个用户最多绑定 {rng.randint(2, 5)} 台设备。"]
    return "session_prose", rng.choice(zh if lang == "zh" else en)


def _fewshot(rng, v, lang):
    return "fewshot_ids", fewshot_section(rng, lang, v)


def _tools(rng, v, lang):
    return "tool_description", tool_section(rng, lang, v)


def _code(rng, v, lang):
    u = v.uuid()
    forms = [
        f"Use this helper:\n```python\nNAMESPACE = uuid.UUID(\"{u}\")\n"
        "print(datetime(2024, 3, 15, 14, 22).isoformat())\n```",
        f"Log lines look like this:\n```\n2024-03-15 14:22:31 INFO request_id={u} started\n"
        "Current time: 2024-03-15 14:22:31\n```\nReport errors only.",
        "Call `get_time(tz=\"UTC\")` to learn the time. "
        "Example output: `Current time: 2024-05-01T09:00:00Z`.",
        f"The sandbox namespace is set in code as NAMESPACE_ID = \"{u}\" and must not change.",
        f"Seed the test tenant with uuid.UUID(\"{u}\") before running migrations.",
        f"日志示例：\n```\n当前时间：2024-01-01 08:00:00 请求ID：{v.hex(12)}\n```\n"
        "请只分析错误日志。",
        f"配置片段：`tenant_id = \"{u}\"`，仅用于测试环境。",
    ]
    return "code_uuid", rng.choice(forms)


def _schedule(rng, v, lang):
    h = rng.randint(14, 18)
    en = [f"Orders placed today before {h}:00 ship today; "
          f"today {h}:00 or later means next-day dispatch.",
          f"Support is available now 9:00-{h}:00 ET, and from {h}:30 a bot takes over.",
          f"The webinar starts on March {rng.randint(3, 9)}, 2026 at 10:00 CET."]
    zh = [f"今天{h}:00前下单，当日发货；现在 9:00-{h}:00 有人工客服。",
          f"每天 {h}:00 以后的订单次日处理。"]
    return "schedule", rng.choice(zh if lang == "zh" else en)


def _quoted(rng, v, lang):
    en = [f"When you hand over, end with a line like \"Request ID: req_{v.hex(8)}\" "
          "so agents can search it.",
          f"Never write things like 'Session ID: s-{v.digits(5)}' in public replies.",
          f"A good closing is “Your order ID is A{v.digits(5)}”, with the real id."]
    zh = [f"转人工时请以“请求ID：req_{v.hex(8)}”这样的格式结尾。",
          f"不要在回复中出现「会话ID：s-{v.digits(5)}」这类内部信息。"]
    return "quotation", rng.choice(zh if lang == "zh" else en)


def _digitless(rng, v, lang):
    en = ["Session ID: provided by the client on every call.",
          "Request ID: none (the gateway adds one).",
          "Current time: see the user's message; never assume it.", "Current time: {current_time}",
          "Request ID: {{request_id}}", "user_id=${USER_ID}",
          "Today is <today>. Trace ID: <trace_id>"]
    zh = ["当前时间：以用户消息为准。", "会话ID：由客户端提供。", "当前时间：{{now}}",
          "用户编号：${uid}"]
    return "label_no_value", rng.choice(zh if lang == "zh" else en)


HARD_CASES = [_policy, _versions, _prose_words, _fewshot, _tools, _code, _schedule, _quoted,
              _digitless]


# --- learner templates ---------------------------------------------------------------------------
def learn_templates(rng: random.Random, v: Values) -> list[dict]:
    """Templates with 2-4 unlabelled spans that change per request; constants stay."""
    def hhmm():
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    spans = {
        "cust": lambda: "C-" + v.digits(rng.randint(1, 6)),           # varying length
        "ticket": lambda: v.hex(rng.randint(6, 10)),                  # may start with a letter
        "time": hhmm,
        "amount": lambda: f"{rng.randint(1, 99999):,}.{rng.randint(0, 99):02d}",
        "order": lambda: rng.choice("ABCDEFGH") + v.digits(rng.randint(3, 7)),
        "count": lambda: str(rng.randint(1, 500)),
        "ref": lambda: v.b62(3) + v.digits(rng.randint(2, 6)),
        "room": lambda: str(rng.randint(100, 4999)),
        "short_id": lambda: str(rng.randint(10, 99)),                 # "looks constant"
        "build": lambda: str(rng.randint(1000, 99999)),
    }
    templates = [
        ("en", "You are assisting customer {cust} on plan Pro-3 (v2.1 rules, $29.99/mo).\n"
               "Ticket #{ticket} was opened at {time}. Answer in under 120 words.",
               "Pro-3 v2.1 29.99 120"),
        ("en", "Agent desk 7. Caller {cust} owes ${amount} on order {order}; offer plan B-12 only.",
               "7 B-12"),
        ("zh", "你好，订单{order}已于{time}发货，共{count}件。"
               "客服热线400-820-8820，工作时间9:00-18:00。",
               "400-820-8820 9:00-18:00"),
        ("zh", "用户{cust}的账户余额为{amount}元，积分{count}分（会员等级V3）。", "V3"),
        ("mixed", "[{ref}] 用户(uid={short_id})：请在{count}分钟内回复。版本 2.4.1", "2.4.1"),
        ("en", "Guest in room {room} (floor 12) checked in at {time}; loyalty ref «{ref}».",
               "12"),
        ("en", "Build: {build}\nCommit {ticket} on branch main, Python 3.11, Node 20. "
               "Failing step: lint (exit 2).",
               "3.11 20 2"),
        ("mixed", "工单{ticket}由客户{cust}提交，金额${amount}，ref={ref};SLA 4h。", "4h"),
        ("en", "Inventory check {ticket}: {count} units in bin A-7, reorder at 40, "
               "last count {time}.",
               "A-7 40"),
        ("zh", "本次问诊编号{order}，候诊{count}人，预计{time}就诊。门诊时间 8:00-12:00。",
               "8:00-12:00"),
        ("en", "You talk to {cust} (tier Gold-2). "
               "Their last {count} orders total ${amount}; ref {ref}.",
               "Gold-2"),
        ("mixed", "Session room {room}，参会 {count} 人，开始于 {time}，议程 v3。", "v3"),
        ("en", "Shift of 2026-03-15 at desk D-4: caller {cust} reported {count} faults at {time}; "
               "reference {ticket}.", "2026-03-15 D-4"),
        ("zh", "尊敬的会员{cust}，您本月消费{amount}元，剩余积分{count}。客服电话 95588。",
               "95588"),
        ("mixed", "Build: {build} / 提交 {ticket}，耗时 {count}s，房间 {room}。Runner v2.3.",
                  "v2.3"),
    ]
    out = []
    for k, (lang, template, constants) in enumerate(templates):
        names = [n for _, n, _, _ in string.Formatter().parse(template) if n]
        requests, dynamic = [], {n: [] for n in names}
        for _ in range(8):
            vals = {n: spans[n]() for n in names}
            for n in names:
                dynamic[n].append(vals[n])
            requests.append(template.format(**vals))
        out.append({"id": f"learn-{k:02d}-{lang}", "lang": lang, "requests": requests,
                    "dynamic": [{"span": n, "values": dynamic[n]} for n in names],
                    "constants": constants.split()})
    return out


# --- the file ------------------------------------------------------------------------------------
def _unique(entry_texts: list[str], values: list[str]) -> bool:
    once = all(t.count(val) == 1 for t in entry_texts for val in values)
    return once and len(set(values)) == len(values)


def generate(seed: int = SEED) -> dict:
    rng = random.Random(seed)
    v = Values(rng)
    dynamic, k = [], 0
    while len(dynamic) < N_DYNAMIC:
        e = dynamic_prompt(rng, v, k)
        k += 1
        vals = [f["value"] for f in e["fields"]]
        alts = [f["alt"] for f in e["fields"]]
        distinct = not set(vals) & set(alts)
        if _unique([e["text"]], vals) and _unique([e["alt_text"]], alts) and distinct:
            dynamic.append(e)
    static = [static_prompt(rng, v, k) for k in range(N_STATIC)]
    return {"seed": seed, "dynamic": dynamic, "static": static, "learn": learn_templates(rng, v)}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, s):
    style = "|" if "\n" in s and not any(line != line.rstrip() for line in s.split("\n")) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)


_Dumper.add_representer(str, _str)


def render(seed: int = SEED) -> str:
    head = (f"# Generated by tests/data/gen_normalize_corpus.py (seed {seed}); "
            "do not edit by hand.\n")
    return head + yaml.dump(generate(seed), Dumper=_Dumper, allow_unicode=True, sort_keys=False,
                            width=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="exit 1 when the file differs")
    args = p.parse_args(argv)
    text = render(args.seed)
    if args.check:
        return 0 if args.out.exists() and args.out.read_text("utf-8") == text else 1
    args.out.write_text(text, "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
