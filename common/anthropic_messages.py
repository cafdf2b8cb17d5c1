"""Anthropic's Messages API in chat terms: a `/v1/messages` request as the OpenAI chat request
vLLM turns it into (vllm/entrypoints/anthropic/serving.py, 0.32), so the gateway renders and
hashes the prompt the engine will see, and the bundled engine serves Messages through its chat
path. Facts from vLLM's conversion, kept here:

- `system` (a string or text blocks, joined with no separator) is the first system message;
  a text block starting with `x-anthropic-billing-header` (Claude Code's per-request
  attribution, a hash that would defeat every prefix cache) is dropped, there and in inline
  system messages (a top-level system string is kept whole, as vLLM keeps it);
- a message's text blocks become its content (one block: a string; several: text parts);
  `tool_use` blocks the assistant's `tool_calls` (arguments: `json.dumps(input)`); a user's
  `tool_result` a `tool` message (its text blocks joined with newlines; its images a user
  message after it, its tool references a `tool` message) placed before the rest of that user
  message, which is dropped when nothing else is left; `thinking` the assistant's
  `reasoning`; an assistant's `tool_result` the text `Tool result: ...`;
- `tools` become functions (`input_schema` is `parameters`, "object" typed when it has no
  type; `strict`, `defer_loading` when set), `tool_choice` auto / any ->
  required / none / a named function; `stop_sequences` is `stop`; a stream asks for usage.

Inline system messages stay where they are unless the chat template needs system first
(`merge_inline_system`: vLLM probes the template, as `needs_system_first` does; they then join
the leading system text).
"""
from __future__ import annotations

import json

BILLING_HEADER = "x-anthropic-billing-header"
# sampling fields with the same name and meaning in both APIs
SHARED_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream",
                 "cache_salt", "kv_transfer_params", "chat_template_kwargs")


def to_chat(body: dict, merge_inline_system: bool = False) -> dict:
    """The chat request vLLM makes of the Messages request `body` (module doc). Shapes it
    does not know are passed over, not refused: the engine is the authority on those."""
    messages = _system(body, merge_inline_system)
    for msg in body.get("messages") or ():
        if isinstance(msg, dict):
            _message(msg, messages, merge_inline_system)
    chat = {k: body[k] for k in SHARED_FIELDS if body.get(k) is not None}
    chat["messages"] = messages
    if body.get("max_tokens") is not None:
        chat["max_completion_tokens"] = body["max_tokens"]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat.update(choice)
    tools = tools_of(body)
    if tools is not None:
        chat["tools"] = tools
        chat.setdefault("tool_choice", "auto")
    return chat


def _system(body: dict, merge_inline_system: bool) -> list[dict]:
    system = body.get("system")
    # vLLM drops the billing header from system blocks and inline system messages, not from a
    # top-level system string
    parts = [system if isinstance(system, str) else _system_text(system)]
    if merge_inline_system:
        parts += [_system_text(m.get("content")) for m in body.get("messages") or ()
                  if isinstance(m, dict) and m.get("role") == "system"]
    text = "".join(p for p in parts if p)
    return [{"role": "system", "content": text}] if text else []


def _system_text(content) -> str | None:
    """A system prompt's text, billing headers dropped (None: nothing left)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        return None
    text = "".join(b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str) and b["text"]
                   and not b["text"].startswith(BILLING_HEADER))
    return text or None


def _message(msg: dict, out: list[dict], merge_inline_system: bool) -> None:
    role, content = msg.get("role"), msg.get("content")
    if role == "system":
        text = None if merge_inline_system else _system_text(content)
        if text:
            out.append({"role": "system", "content": text})
        return
    chat: dict = {"role": role}
    if isinstance(content, str):
        chat["content"] = content
    elif isinstance(content, list):
        _blocks(role, content, chat, out)
    if not (role == "user" and "content" not in chat):
        out.append(chat)


def _blocks(role, blocks: list, chat: dict, out: list[dict]) -> None:
    parts, calls, reasoning = [], [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or "call_0", "type": "function",
                          "function": {"name": block.get("name") or "",
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            _tool_result(block, out)
        elif kind == "tool_result":
            text = str(block.get("content")) if block.get("content") else ""
            parts.append({"type": "text", "text": f"Tool result: {text}"})
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        chat["content"] = parts[0]["text"]
    elif parts:
        chat["content"] = parts


def _tool_result(block: dict, out: list[dict]) -> None:
    """A user's tool_result: a `tool` message of its text blocks joined with newlines, then
    (as vLLM) a user message of its images and a `tool` message of its tool references."""
    call_id, content = block.get("tool_use_id") or "", block.get("content")
    items = [i for i in content if isinstance(i, dict)] if isinstance(content, list) else []
    text = content if isinstance(content, str) else "\n".join(
        i.get("text", "") for i in items if i.get("type") == "text")
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    images = [_image_url(i.get("source") or {}) for i in items if i.get("type") == "image"]
    images = [url for url in images if url]
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}
                                                for url in images]})
    refs = [i.get("tool_name") or i.get("name") for i in items if i.get("type") == "tool_reference"]
    refs = [{"type": "tool_reference", "name": name} for name in refs if name]
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})


def _image_url(source: dict) -> str:
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_choice(choice) -> dict | None:
    if not isinstance(choice, dict):
        return None
    out: dict = {"parallel_tool_calls": not choice.get("disable_parallel_tool_use", False)}
    kind = choice.get("type")
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    return out


def tools_of(body: dict) -> list[dict] | None:
    """The request's tools as chat functions (None: it has none)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    return [_tool(t) for t in tools if isinstance(t, dict)]


def _tool(tool: dict) -> dict:
    """One tool as vLLM hands it on: `input_schema` is `parameters` (typed "object" when it
    says no type), `strict` and `defer_loading` only when set."""
    schema = tool.get("input_schema")
    if isinstance(schema, dict) and "type" not in schema:
        schema = {**schema, "type": "object"}
    function = {"name": tool.get("name"), "description": tool.get("description"),
                "parameters": schema}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


PROBE_MESSAGES = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]


def needs_system_first(chat_template) -> bool:
    """`merge_inline_system` for a model's chat template (a source, a {name: source} set, or
    None), probed as vLLM's `_should_merge_inline_system` probes it: render [system, user,
    system, user] in a bare jinja2 sandbox (no template globals, so a template that calls
    raise_exception, strftime_now, ... fails too) with the template used without tools and
    with `tools=[]` (a set's `tool_use` entry); any failure, or no template, means yes."""
    if isinstance(chat_template, dict):
        default = chat_template.get("default")
        sources = [default, chat_template.get("tool_use", default)]
    else:
        sources = [chat_template]
    return any(_fails_inline_system(source) for source in sources)


def _fails_inline_system(source) -> bool:
    import jinja2.ext
    import jinja2.sandbox

    if not source:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    try:
        env.from_string(source).render(messages=PROBE_MESSAGES, add_generation_prompt=False)
    except Exception:       # jinja2.TemplateError as vLLM catches; anything else: vLLM fails
        return True
    return False
