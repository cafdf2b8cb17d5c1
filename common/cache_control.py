"""Cache breakpoints: where a client says it will send the same prefix again, and for how long.

Anthropic's `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on a tool, a system
block or a message's content block marks the prompt up to and including that block, in
Anthropic's order (tools, then system, then messages), as a prefix the next request will
repeat. A request-level `cache_control` (the anthropic SDK 2.x's automatic caching) marks the
whole prompt: its breakpoint is the last message's last block. OpenAI chat requests carry the
same marks on content parts and tools (as OpenRouter and LiteLLM pass them through), so both
APIs are read alike. The `ttl` is 5 minutes unless it says `1h`; Anthropic takes at most four
breakpoints per request and so do we.

The gateway routes on the prefix up to the last breakpoint; the bundled engine keeps the KV
of each breakpoint's prefix resident for its ttl. Both cut the request with `prefix_of`.
"""
from __future__ import annotations

from dataclasses import dataclass

TTLS = {"5m": 300.0, "1h": 3600.0}
DEFAULT_TTL = "5m"
MAX_BREAKPOINTS = 4


class CacheControlError(ValueError):
    """A `cache_control` the API would refuse (the message says where and why)."""


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The end of a marked prefix: how many tools, system blocks and whole messages it holds,
    then how many content blocks of the message after them (0: none)."""
    ttl_s: float
    tools: int
    system: int
    messages: int
    blocks: int


def ttl_of(mark, where: str) -> float:
    """The seconds a `cache_control` value keeps its prefix; CacheControlError if malformed."""
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise CacheControlError(f"{where}.cache_control: expected "
                                f"{{\"type\": \"ephemeral\"}}, got {mark!r}")
    ttl = mark.get("ttl", DEFAULT_TTL)
    if ttl not in TTLS:
        raise CacheControlError(f"{where}.cache_control.ttl: expected one of "
                                f"{sorted(TTLS)}, got {ttl!r}")
    return TTLS[ttl]


def breakpoints(body: dict) -> list[Breakpoint]:
    """The request's breakpoints in prompt order (a Messages or a chat request)."""
    found: list[Breakpoint] = []
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("cache_control") is not None:
            found.append(Breakpoint(ttl_of(tool["cache_control"], f"tools[{i}]"), i + 1, 0, 0, 0))
    system = body.get("system") if isinstance(body.get("system"), list) else []
    for i, block in enumerate(system):
        if isinstance(block, dict) and block.get("cache_control") is not None:
            found.append(Breakpoint(ttl_of(block["cache_control"], f"system[{i}]"),
                                    len(tools), i + 1, 0, 0))
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    for m, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        for c, block in enumerate(content if isinstance(content, list) else ()):
            if isinstance(block, dict) and block.get("cache_control") is not None:
                found.append(Breakpoint(ttl_of(block["cache_control"],
                                               f"messages[{m}].content[{c}]"),
                                        len(tools), len(system), m, c + 1))
    if body.get("cache_control") is not None and messages:
        last = messages[-1].get("content") if isinstance(messages[-1], dict) else None
        blocks = len(last) if isinstance(last, list) else 1
        found.append(Breakpoint(ttl_of(body["cache_control"], "request"), len(tools),
                                len(system), len(messages) - 1, blocks))
    if len(found) > MAX_BREAKPOINTS:
        raise CacheControlError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control "
                                f"may be provided. Found {len(found)}.")
    return sorted(found, key=lambda b: (b.messages, b.blocks, b.system, b.tools))


def prefix_of(body: dict, bp: Breakpoint) -> dict:
    """The request cut just after the breakpoint's block: what the next request repeats.
    A tool's breakpoint keeps no system and no message; a system block's keeps no message."""
    cut = {k: v for k, v in body.items() if k not in ("tools", "system", "messages",
                                                      "cache_control")}
    if isinstance(body.get("tools"), list):
        cut["tools"] = body["tools"][:bp.tools]
    system = body.get("system")
    in_tools = bp.system == 0 and bp.messages == 0 and bp.blocks == 0
    if system is not None and not in_tools:
        cut["system"] = system[:bp.system] if isinstance(system, list) else system
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    kept = list(messages[:bp.messages])
    if bp.blocks and bp.messages < len(messages):
        msg = messages[bp.messages]
        content = msg.get("content")
        kept.append({**msg, "content": content[:bp.blocks]} if isinstance(content, list)
                    else msg)
    cut["messages"] = kept
    return cut
