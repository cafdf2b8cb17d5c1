"""normalize on coding agents' requests: Anthropic Messages bodies (`/v1/messages`) shaped like
Claude Code's and Codex's, the environment they put near the head of a prompt (date, working
directory, git branch, status and commits, platform, shell, time zone), and session and
request ids of every common shape.

Two sessions that differ only in those values must normalize to byte-identical requests up
to the tail block, with every value still there exactly once and the request still a valid
Messages request; prompts that only mention such fields pass byte-identical.
"""
from __future__ import annotations

import copy
import json
import random
import re

import aiohttp
import pytest

from prefixgate.common.anthropic_messages import to_chat
from prefixgate.common.schema import check
from prefixgate.plugins.normalize import detectors
from prefixgate.plugins.normalize.learner import template_key
from prefixgate.plugins.normalize.plugin import CLOSE, OPEN, SPEC, Normalizer
from prefixgate.plugins.normalize.suffix_reuse import reuse
from tests.plugins.helpers import normalizer

# --- Claude Code ---------------------------------------------------------------------------------
CC_INTRO = "You are Claude Code, Anthropic's official CLI for Claude."
CC_RULES = ("You are an interactive CLI tool that helps users with software engineering tasks. "
            "Use the instructions below and the tools available to you to assist the user.\n\n"
            "# Tone and style\nYou should be concise, direct, and to the point. When you run a "
            "non-trivial bash command, explain what it does. Only use emojis if asked.\n\n"
            "# Doing tasks\n- Use the TodoWrite tool to plan the task if required\n"
            "- NEVER commit changes unless the user explicitly asks you to.\n"
            "- When the user asks for the git status, run `git status` with Bash.\n\n"
            "# Code References\nWhen referencing code use the pattern `file_path:line_number`, "
            "e.g. `src/services/process.ts:712`.\n")
CC_ENV = ("Here is useful information about the environment you are running in:\n<env>\n"
          "Working directory: {cwd}\nIs directory a git repo: Yes\nPlatform: {platform}\n"
          "OS Version: {os}\nToday's date: {date}\n</env>\n"
          "You are powered by the model named Sonnet 4.5. The exact model ID is "
          "claude-sonnet-4-5-20250929.\n\nAssistant knowledge cutoff is January 2025.\n\n"
          "IMPORTANT: Always use the TodoWrite tool to plan and track tasks.\n\n"
          "gitStatus: This is the git status at the start of the conversation. Note that this "
          "status is a snapshot in time, and will not update during the conversation.\n"
          "Current branch: {branch}\n\nMain branch (you will usually use this for PRs): main\n\n"
          "Git user: {user}\n\nStatus:\n{status}\n\nRecent commits:\n{commits}")
CC_TOOLS = [
    {"name": "Bash", "description": "Executes a given bash command in a persistent shell "
     "session. The working directory persists between commands.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                       "timeout": {"type": "number"}},
                      "required": ["command"]}},
    {"name": "Read", "description": "Reads a file from the local filesystem.",
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                      "required": ["file_path"]}},
]
CC_SESSIONS = [
    {"cwd": "/Users/alice/src/shop", "platform": "darwin", "os": "Darwin 24.6.0",
     "date": "2026-03-15", "branch": "feat/cart-totals", "user": "Alice Zenner",
     "status": "M src/cart.ts\n?? notes.md", "commits": "a1b2c3d Fix cart rounding\n"
     "b2c3d4e Add totals endpoint\n9f8e7d6 Bump deps"},
    {"cwd": "/home/bob/work/shop-checkout", "platform": "linux",
     "os": "Linux 6.8.0-45-generic", "date": "2026-03-16", "branch": "fix/tax",
     "user": "Bob Li", "status": " M src/tax.ts\nA  src/tax.test.ts\nR  old.md -> new.md",
     "commits": "0c1d2e3 Tax rounding per line\n4f5a6b7 Add VAT table"},
]


def claude_code(env: dict) -> dict:
    """A Claude Code turn as it reaches the gateway: system blocks (the per-request billing
    header first, `cache_control` on the last), Anthropic tools, a `tool_use` / `tool_result`
    history, the user's context reminder first."""
    return {
        "model": "standin-model", "max_tokens": 64,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0.14.a1f; "
                                     "cc_entrypoint=cli; cch=8d4f2"},
            {"type": "text", "text": CC_INTRO, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": CC_RULES + "\n" + CC_ENV.format(**env),
             "cache_control": {"type": "ephemeral"}}],
        "tools": copy.deepcopy(CC_TOOLS),
        "metadata": {"user_id": "user_5f1c_account__session_0b4c8f6e"},
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, "
                                         "you can use the following context:\n# claudeMd\n"
                                         "Run tests with `npm test`.\n</system-reminder>"},
                {"type": "text", "text": "Why is the cart total off by a cent?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look at the rounding.", "signature": "sig1"},
                {"type": "text", "text": "Let me look at the cart code."},
                {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "Read",
                 "input": {"file_path": env["cwd"] + "/src/cart.ts"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                 "content": "export const total = (xs) => xs.reduce((a, x) => a + x, 0)"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_01B7Xk2Lm9Pq4Rs8Tu3Vw6Yz", "name": "Bash",
                 "input": {"command": "git log -1 --format=%cd", "timeout": 5000}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01B7Xk2Lm9Pq4Rs8Tu3Vw6Yz",
                 "content": [{"type": "text", "text": f"Today's date: {env['date']}"}],
                 "cache_control": {"type": "ephemeral"}}]},
        ]}


# --- Codex ---------------------------------------------------------------------------------------
CODEX_SESSIONS = [
    {"cwd": "/Users/alice/src/api", "shell": "zsh", "date": "2026-03-15",
     "tz": "America/Los_Angeles"},
    {"cwd": "/home/bob/checkouts/api-7", "shell": "bash", "date": "2026-03-16",
     "tz": "Europe/Berlin"},
]
CODEX_ENV = ("<environment_context>\n  <cwd>{cwd}</cwd>\n  <approval_policy>on-request"
             "</approval_policy>\n  <sandbox_mode>workspace-write</sandbox_mode>\n"
             "  <network_access>restricted</network_access>\n  <shell>{shell}</shell>\n"
             "  <current_date>{date}</current_date>\n  <timezone>{tz}</timezone>\n"
             "</environment_context>")
CODEX_INSTRUCTIONS = ("You are Codex, a coding agent based on GPT-5. You and the user share the "
                      "same workspace and collaborate to achieve the user's goals.\n\n"
                      "## Sandbox and approvals\nThe Codex CLI harness supports several sandbox "
                      "modes; approval_policy says when to ask the user.\n")
CODEX_TASK = "Add a /healthz endpoint and a test for it."


def codex(env: dict) -> dict:
    """A Codex-shaped session over Messages: the instructions as the system prompt, then the
    first user message with AGENTS.md and the `<environment_context>` before the task (Codex
    sends these as user items); batch runs of one task over many checkouts differ only there."""
    return {
        "model": "standin-model", "max_tokens": 64, "system": CODEX_INSTRUCTIONS,
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "# AGENTS.md instructions\n\n<INSTRUCTIONS>\n"
                                         "Use pytest; keep handlers small.\n</INSTRUCTIONS>"},
                {"type": "text", "text": CODEX_ENV.format(**env)},
                {"type": "text", "text": CODEX_TASK}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_8Jd0x2sYq1", "name": "shell",
                 "input": {"command": ["rg", "-n", "app.get"], "workdir": env["cwd"]}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_8Jd0x2sYq1",
                 "content": "src/app.py:12:@app.get('/')"}]},
        ]}


def codex_values(env: dict) -> list[str]:
    return [env["cwd"], env["shell"], env["date"], env["tz"]]


def cc_values(env: dict) -> list[str]:
    return [env[k] for k in ("cwd", "platform", "os", "date", "branch", "user", "status",
                             "commits")]


# --- helpers -------------------------------------------------------------------------------------
def messages_normalizer(**cfg) -> Normalizer:
    return normalizer(**cfg)


def without_tail(body: dict) -> dict:
    """The request less its tail block: what two sessions must share byte for byte."""
    body = copy.deepcopy(body)
    last = next(m for m in reversed(body["messages"]) if m["role"] == "user")
    content = last["content"]
    if isinstance(content, str):
        last["content"] = content.split("\n\n" + OPEN)[0]
        return body
    block = content[-1]
    if block["text"].startswith(OPEN):
        content.pop()
    else:
        block["text"] = block["text"].split("\n\n" + OPEN)[0]
    return body


def tail_of(body: dict) -> str:
    last = next(m for m in reversed(body["messages"]) if m["role"] == "user")
    text = last["content"] if isinstance(last["content"], str) else last["content"][-1]["text"]
    return text[text.index(OPEN):]


def valid_messages(body: dict) -> None:
    """What Anthropic's Messages API asks of a request that normalize could break."""
    assert isinstance(body["messages"], list) and body["messages"][0]["role"] == "user"
    for msg in body["messages"]:
        assert msg["role"] in ("user", "assistant")
        content = msg["content"]
        assert isinstance(content, str) or all(isinstance(b, dict) and "type" in b
                                               for b in content)
        if msg["role"] == "user" and isinstance(content, list):
            kinds = [b["type"] for b in content]
            results = [i for i, k in enumerate(kinds) if k == "tool_result"]
            assert results == list(range(len(results))), kinds   # tool_result blocks first
        for b in content if isinstance(content, list) else ():
            if b["type"] == "text":
                assert isinstance(b["text"], str) and b["text"]
    system = body.get("system")
    assert system is None or isinstance(system, str) or all(
        b["type"] == "text" and isinstance(b["text"], str) for b in system)
    to_chat(body)                                   # and vLLM's conversion takes it


def prompt_text(body: dict) -> str:
    """Every text normalize may read or write: `system` and the messages' text blocks."""
    system = body.get("system")
    out = [system] if isinstance(system, str) else [b["text"] for b in system or ()]
    for msg in body["messages"]:
        content = msg["content"]
        out += [content] if isinstance(content, str) else [
            b["text"] for b in content if b["type"] == "text"]
    return "\n".join(out)


def once_each(body: dict, values: list[str]) -> None:
    text = prompt_text(body)
    for v in values:
        assert text.count(v) == 1, v


def untouched_parts(before: dict, after: dict) -> None:
    """tool_use inputs, tool_result contents, thinking, tools, metadata and every block's own
    keys but its text come through as they were."""
    assert after["tools"] == before["tools"] and after.get("metadata") == before.get("metadata")
    for a, b in zip(before["messages"], after["messages"]):
        if isinstance(a["content"], list):
            for x, y in zip(a["content"], b["content"]):
                if x["type"] != "text":
                    assert x == y
                else:
                    assert {k: v for k, v in x.items() if k != "text"} == \
                        {k: v for k, v in y.items() if k != "text"}
    if isinstance(before.get("system"), list):
        for x, y in zip(before["system"], after["system"]):
            assert {k: v for k, v in x.items() if k != "text"} == \
                {k: v for k, v in y.items() if k != "text"}
        assert after["system"][0] == before["system"][0]      # the billing header: left alone


# --- Claude Code over /v1/messages ---------------------------------------------------------------
def test_claude_code_sessions_share_everything_up_to_the_tail():
    n = messages_normalizer()
    bodies, originals = [], []
    for env in CC_SESSIONS:
        body = claude_code(env)
        originals.append(copy.deepcopy(body))
        moved = n.normalize(body, messages_api=True)
        assert sorted(m["value"] for m in moved) == sorted(cc_values(env))
        assert {m["message"] for m in moved} == {"system"}
        bodies.append(body)
    a, b = bodies
    # the tool_use input and tool_result hold session values too, and stay where they are
    heads = [json.dumps(without_tail(x), ensure_ascii=False) for x in bodies]
    for env in CC_SESSIONS:
        heads = [h.replace(env["cwd"] + "/src", "CWD/src").replace(
            f"Today's date: {env['date']}\"", "TOOL_DATE\"") for h in heads]
    assert heads[0] == heads[1]
    for body, original, env in zip(bodies, originals, CC_SESSIONS):
        valid_messages(body)
        untouched_parts(original, body)
        system = body["system"][2]["text"]
        assert "<env>\nIs directory a git repo: Yes\n</env>" in system
        assert "Main branch (you will usually use this for PRs): main" in system
        tail = tail_of(body)
        for v in cc_values(env):
            assert v not in system and v in tail
        assert f"Status:\n{env['status']}\n" in tail and "Working directory: " + env["cwd"] in tail
        # the last user message holds only tool results: the tail is a text block after them
        last = body["messages"][-1]["content"]
        assert [x["type"] for x in last] == ["tool_result", "text"]
        assert last[-1] == {"type": "text", "text": tail} and tail.endswith(CLOSE)
        # what vLLM renders: the tail is the last thing the model reads
        chat = to_chat(body)
        assert chat["messages"][-1]["role"] == "user" and chat["messages"][-1]["content"] == tail
        assert chat["messages"][0]["content"].startswith(CC_INTRO)
    for body, env in zip(bodies, CC_SESSIONS):
        once_each(body, cc_values(env))


def test_messages_normalize_is_idempotent_and_the_opt_out_and_plain_prompts_stay():
    n = messages_normalizer()
    body = claude_code(CC_SESSIONS[0])
    n.normalize(body, messages_api=True)
    again = copy.deepcopy(body)
    assert n.normalize(again, messages_api=True) == [] and again == body
    static = claude_code(CC_SESSIONS[0])
    static["system"][2]["text"] = CC_RULES
    before = copy.deepcopy(static)
    assert n.normalize(static, messages_api=True) == [] and static == before


def test_tail_goes_into_the_last_text_block_or_a_string_or_the_system_tail():
    env = CC_SESSIONS[0]
    body = claude_code(env)
    body["messages"][-1] = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01B7Xk2Lm9Pq4Rs8Tu3Vw6Yz", "content": "ok"},
        {"type": "text", "text": "Now fix it.", "cache_control": {"type": "ephemeral"}}]}
    messages_normalizer().normalize(body, messages_api=True)
    last = body["messages"][-1]["content"]
    assert len(last) == 2 and last[1]["text"].startswith("Now fix it.\n\n" + OPEN)
    assert last[1]["cache_control"] == {"type": "ephemeral"}
    valid_messages(body)

    body = claude_code(env)
    body["messages"] = [{"role": "user", "content": "Why is the cart total off by a cent?"}]
    messages_normalizer().normalize(body, messages_api=True)
    assert body["messages"][0]["content"].startswith("Why is the cart total off by a cent?\n\n"
                                                     + OPEN)
    valid_messages(body)

    body = claude_code(env)
    before = copy.deepcopy(body["messages"])
    messages_normalizer(move_to="system_tail").normalize(body, messages_api=True)
    assert body["messages"] == before
    assert body["system"][-1]["text"].startswith(OPEN) and body["system"][-1]["type"] == "text"
    assert len(body["system"]) == 4
    valid_messages(body)
    # a system string takes the block at its end
    body = {"model": "m", "max_tokens": 8, "system": "Today's date: 2026-03-15\nBe brief.",
            "messages": [{"role": "user", "content": "hi"}]}
    messages_normalizer(move_to="system_tail").normalize(body, messages_api=True)
    assert body["system"] == f"Be brief.\n\n{OPEN}\nToday's date: 2026-03-15\n{CLOSE}"
    assert messages_normalizer(move_to="system_tail").normalize(
        copy.deepcopy(body), messages_api=True) == []


def test_first_messages_are_scanned_as_configured_for_chat_never_tool_parts():
    env = CC_SESSIONS[0]
    body = claude_code(env)
    body["system"] = "Be brief."
    body["messages"][0]["content"][0]["text"] = "Today's date is 2026-03-15."
    body["messages"][1]["content"][1]["text"] = "Session ID: sess_8Kq2Lm9Pq4Rs8Tu3"
    plain = copy.deepcopy(body)
    assert messages_normalizer().normalize(plain, messages_api=True) == []
    moved = messages_normalizer(scan_first=2).normalize(body, messages_api=True)
    assert [(m["message"], m["value"]) for m in moved] == [(0, "2026-03-15"),
                                                           (1, "sess_8Kq2Lm9Pq4Rs8Tu3")]
    # a text block all of which moved keeps its label, with a placeholder: Messages refuses
    # an empty text block
    assert body["messages"][0]["content"][0]["text"] == "Today's date is ⟨1⟩."
    assert body["messages"][1]["content"][1]["text"] == "Session ID: ⟨2⟩"
    # the tool_result with "Today's date: …" and the tool_use input with the cwd: untouched
    assert body["messages"][4]["content"][0] == plain["messages"][4]["content"][0]
    assert body["messages"][1]["content"][2] == plain["messages"][1]["content"][2]
    valid_messages(body)


# --- Codex ---------------------------------------------------------------------------------------
def test_codex_sessions_share_everything_up_to_the_tail():
    bodies = []
    n = messages_normalizer(scan_first=1)
    for env in CODEX_SESSIONS:
        body = codex(env)
        original = copy.deepcopy(body)
        moved = n.normalize(body, messages_api=True)
        assert sorted(m["value"] for m in moved) == sorted(codex_values(env))
        valid_messages(body)
        untouched_parts({**original, "tools": None}, {**body, "tools": None})
        context = body["messages"][0]["content"][1]["text"]
        assert context == ("<environment_context>\n  <approval_policy>on-request"
                           "</approval_policy>\n  <sandbox_mode>workspace-write</sandbox_mode>\n"
                           "  <network_access>restricted</network_access>\n"
                           "</environment_context>")
        tail = tail_of(body)
        assert tail == (f"{OPEN}\ncwd: {env['cwd']}\nshell: {env['shell']}\n"
                        f"current_date: {env['date']}\ntimezone: {env['tz']}\n{CLOSE}")
        bodies.append(body)
    heads = [json.dumps(without_tail(b)) for b in bodies]
    for env in CODEX_SESSIONS:                  # the tool_use input's workdir stays, as sent
        heads = [h.replace(json.dumps(env["cwd"]), '"WORKDIR"') for h in heads]
    assert heads[0] == heads[1]


def test_codex_over_chat_moves_the_same_fields():
    n = normalizer(scan_first=2)
    bodies = []
    for env in CODEX_SESSIONS:
        body = {"model": "m", "messages": [
            {"role": "developer", "content": CODEX_INSTRUCTIONS},
            {"role": "user", "content": CODEX_ENV.format(**env)},
            {"role": "user", "content": CODEX_TASK}]}
        assert sorted(m["value"] for m in n.normalize(body)) == sorted(codex_values(env))
        bodies.append(body)
    assert [m["content"].split(OPEN)[0] for m in bodies[0]["messages"]] == \
        [m["content"].split(OPEN)[0] for m in bodies[1]["messages"]]


# --- other agents' environment lines -------------------------------------------------------------
@pytest.mark.parametrize("text,values", [
    # Claude Code's newer environment section
    ("# Environment\nYou have been invoked in the following environment:\n"
     " - Primary working directory: /Users/me/proj\n - Is a git repository: true\n"
     " - Platform: darwin\n - Shell: zsh\n - OS Version: Darwin 25.4.0\n",
     ["/Users/me/proj", "darwin", "zsh", "Darwin 25.4.0"]),
    # Cline / Roo Code
    ("====\n\nSYSTEM INFORMATION\n\nOperating System: macOS Sonoma\nDefault Shell: /bin/zsh\n"
     "Home Directory: /Users/me\nCurrent Working Directory: /Users/me/Desktop/app\n",
     ["macOS Sonoma", "/bin/zsh", "/Users/me", "/Users/me/Desktop/app"]),
    # Aider
    ("- Platform: macOS-14.5-arm64-arm-64bit\n- Shell: SHELL=/bin/zsh\n- Language: en_US\n"
     "- Current date: 2026-03-15\n", ["macOS-14.5-arm64-arm-64bit", "SHELL=/bin/zsh",
                                      "2026-03-15"]),
    # Gemini CLI, Windows paths, Chinese labels, markdown emphasis
    ("Today's date is Sunday, March 15, 2026.\nMy operating system is: linux\n"
     "I'm currently working in the directory: /home/me/proj\n",
     ["Sunday, March 15, 2026", "/home/me/proj"]),
    ("**Working directory:** C:\\Users\\me\\repo\n**Current branch:** main\n",
     ["C:\\Users\\me\\repo", "main"]),
    ("工作目录：/data/zhang/项目\n当前分支：feature/登录\n时区：Asia/Shanghai\n",
     ["/data/zhang/项目", "feature/登录", "Asia/Shanghai"]),
    # a path in running text after a path label (Cursor, Cline's tool descriptions)
    ("<user_info>\nThe absolute path of the user's workspace is /Users/me/proj. The user's "
     "shell is /bin/zsh.\n</user_info>", ["/Users/me/proj"]),
    ("Run commands in the current working directory: /srv/app-3 (paths are relative to the "
     "current working directory /srv/app-3).", ["/srv/app-3", "/srv/app-3"]),
])
def test_other_agents_environment_fields_move(text, values):
    body = {"messages": [{"role": "system", "content": text + "\nBe brief."},
                         {"role": "user", "content": "hi"}]}
    moved = normalizer(learn=False).normalize(body)
    assert [m["value"] for m in moved] == values
    system, user = body["messages"][0]["content"], body["messages"][1]["content"]
    tail = user.split(OPEN)[1].split(CLOSE)[0].strip().split("\n")
    assert sorted(re.split("[:：] ?", line, maxsplit=1)[1] for line in tail) == sorted(set(values))
    assert not any(re.search(rf"(?<![\w/]){re.escape(v)}(?![\w/])", system) for v in values)


@pytest.mark.parametrize("text", [
    "Working directory: <path>\nPlatform: <platform>\nToday's date: <date>",
    "Working directory: ${WORKING_DIRECTORY}\nCurrent branch: {{ current_branch }}",
    "Working directory: /path/to/project\nGit user: {user_name}",
    "<example>\nWorking directory: /Users/alice/app\nCurrent branch: feat/x\n</example>",
    "## Examples\nStatus:\nM src/app.py\n?? notes.md\n\n## Rules\nBe brief.",
    "For example, a cwd such as /Users/alice/app is typical.",
    "Status: active\nPlatform: web and mobile\nShell: see the Bash tool\nBranch: see below",
    "Current branch: use `git branch --show-current` to find it.",
    "When the user asks for status, reply with:\nStatus:\n- pending\n- done",
    "Environment:\n- OS: macOS 14.4\n- Python 3.12\nIs directory a git repo: Yes",
    "```\nWorking directory: /Users/alice/app\nCurrent branch: feat/x\n```",
    "<approval_policy>on-request</approval_policy>\n<sandbox_mode>read-only</sandbox_mode>",
    "Main branch (you will usually use this for PRs): main",
    "Recent commits are listed by `git log --oneline`; quote the hash when you refer to one.",
    "Never write to /etc or /usr; the project's output directory is /srv/out.",
    "Use the msg_ prefix for message ids and req_ for request ids (e.g. req_123).",
])
def test_prompts_that_only_mention_environment_fields_stay(text):
    body = {"messages": [{"role": "system", "content": text},
                         {"role": "user", "content": "hi"}]}
    before = copy.deepcopy(body)
    assert normalizer().normalize(body) == [] and body == before


# --- session and request ids of every common shape -----------------------------------------------
ID_SHAPES = {
    "uuid4": "3f2a9c1e-8b7d-4e6f-a5c4-1d2e3f4a5b6c",
    "uuid7": "0190b6e4-3c2d-7a3b-8f1e-8a9b0c1d2e3f",
    "ulid": "01J8ZK3V7Q9W4X2Y6T5R8N1M0P",
    "sess": "sess_01J8ZK3V7Q9W4X2Y6T",
    "req": "req_011CSHg6ZrtSo4jUo7yuqLsU",
    "msg": "msg_01XFDUDYJgAACzvnptvVoYEL",
    "toolu": "toolu_01A09q90qw90lq917835lq9",
    "conv": "conv_68a2f1c9e8b48190a2b6e0d4c3f1e2a7",
    "chatcmpl": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
    "sha1": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b",
    "hex16": "a3bf4f1b2b0b822c",
    "base62": "Zx81KpQ2vLm0TnR7sWyB4c",
    "digitless_hex": "sess_aefdfeeacbdd",
    "digitless_base62": "sess_QmXkPzRtWvYbNc",
}
ID_LABELS = ["Session ID", "session_id", "sessionId", "X-Claude-Code-Session-Id", "Request ID",
             "request-id", "Conversation ID", "thread_id", "Message ID", "Session key",
             "request hash", "session uuid", "会话ID", "请求编号", "对话ID", "消息ID"]


@pytest.mark.parametrize("shape", sorted(ID_SHAPES))
def test_session_and_request_ids_of_every_shape_under_every_label(shape):
    value = ID_SHAPES[shape]
    misses = []
    for label in ID_LABELS:
        for layout in ("{L}: {v}", '"{L}": "{v}"', "{L}={v}", "[{L}: {v}]", "<{L}>{v}</{L}>"):
            text = layout.replace("{L}", label).replace("{v}", value)
            body = {"messages": [{"role": "system", "content": f"Be brief.\n{text}\nThanks."},
                                 {"role": "user", "content": "hi"}]}
            if [m["value"] for m in normalizer(learn=False).normalize(body)] != [value]:
                misses.append(text)
    assert misses == []


@pytest.mark.parametrize("value", [ID_SHAPES[k] for k in ("uuid4", "uuid7", "ulid", "sess", "req",
                                                           "msg", "toolu", "chatcmpl")]
                         + ["resp_68a2f1c9e8b48190a2b6e0d4", "call_8Jd0x2sYq1Hz7Lw3Kp"])
def test_api_minted_ids_move_without_a_label(value):
    body = {"messages": [{"role": "system", "content": f"Continue the work of {value} now."},
                         {"role": "user", "content": "hi"}]}
    assert [m["value"] for m in normalizer(learn=False).normalize(body)] == [value]


# --- the fast path -------------------------------------------------------------------------------
AGENT_TEXTS = [CC_RULES + CC_ENV.format(**env) for env in CC_SESSIONS] + \
    [CODEX_ENV.format(**env) for env in CODEX_SESSIONS]
AGENT_INSERTS = ["Working directory: /Users/x/y\n", "Current branch: main\n", "Status:\nM a.py\n",
                 "?? b.py\n", "Recent commits:\n", "a1b2c3d Fix it\n", "<cwd>/tmp/w</cwd>\n",
                 "\n", "Platform: linux\n", "[Tenant ID: t_aefdfeea]", "msg_01XFDUDYJgAACzvnpt ",
                 "working directory /srv/a ", "x", "", "/", " /usr/bin ", "Shell: zsh"]


def test_reused_analysis_equals_a_full_one_on_agent_prompts():
    rng = random.Random(7)
    n = Normalizer(check({}, SPEC))
    reused = 0
    for _ in range(60):
        base = "\n".join(rng.sample(AGENT_TEXTS, 3)) + "\nBe brief. Rule 7 applies.\n" * 80
        for _ in range(4):
            text = base
            for _ in range(rng.randint(1, 3)):
                i = rng.randint(0, len(text))
                text = text[:i] + rng.choice(AGENT_INSERTS) + text[i + rng.choice([0, 1, 5]):]
            code, old_code = detectors.code_spans(text), detectors.code_spans(base)
            old_toks, old_statics, old_values = detectors.scan(base)
            old_found = n.detector.candidates(base, old_toks, old_code)
            got = reuse(text, code, base, old_toks, old_statics, old_values, old_found, old_code,
                        n.detector)
            toks, statics, values = detectors.scan(text)
            full = (toks, template_key(statics), values, n.detector.candidates(text, toks, code))
            if got is not None:
                reused += 1
                assert (got[0], template_key(got[1]), got[2], got[3]) == full
            base = text if rng.random() < 0.5 else base
    assert reused > 60


# --- through the gateway -------------------------------------------------------------------------
async def test_gateway_upstream_receives_claude_code_sessions_with_one_prefix(make_standin,
                                                                              make_gateway):
    up = await make_standin(tokens=2)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "plugins": [{"normalize": {}}]})
    async with aiohttp.ClientSession() as client:
        for env in CC_SESSIONS:
            async with client.post(gw.url + "/v1/messages", json=claude_code(env),
                                   headers={"anthropic-version": "2023-06-01"}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-prefixgate-moved"] == str(len(cc_values(env)))
                assert (await r.json())["type"] == "message"
    sent = [r["json"] for r in up.requests if r["path"] == "/v1/messages"]
    assert len(sent) == 2
    for body, env in zip(sent, CC_SESSIONS):
        valid_messages(body)
        tail = tail_of(body)
        assert all(v in tail for v in cc_values(env))
    chats = [r["chat"]["messages"] for r in up.requests if r["path"] == "/v1/messages"]
    # what the engine renders: the system prompt, byte for byte, in both sessions
    assert chats[0][0] == chats[1][0] and chats[0][0]["role"] == "system"
    assert chats[0][-1]["content"].startswith(OPEN)
