"""common/cache_control.py: breakpoints read from Messages and chat requests, and the prefix
each one marks; common/block_hash.salted_root."""
import pytest

from prefixgate.common.block_hash import ROOT_HASH, block_hash_chain, salted_root
from prefixgate.common.cache_control import (
    Breakpoint,
    CacheControlError,
    breakpoints,
    prefix_of,
)

EPH = {"type": "ephemeral"}


def messages_request(**extra) -> dict:
    return {"model": "m", "max_tokens": 8,
            "tools": [{"name": "a", "input_schema": {}},
                      {"name": "b", "input_schema": {}, "cache_control": EPH}],
            "system": [{"type": "text", "text": "billing"},
                       {"type": "text", "text": "be brief", "cache_control":
                        {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "q1"}]},
                         {"role": "assistant", "content": "a1"},
                         {"role": "user", "content": [
                             {"type": "text", "text": "q2", "cache_control": EPH},
                             {"type": "text", "text": "tail"}]}],
            **extra}


def test_breakpoints_in_prompt_order_with_their_ttls():
    assert breakpoints(messages_request()) == [
        Breakpoint(300.0, 2, 0, 0, 0), Breakpoint(3600.0, 2, 2, 0, 0),
        Breakpoint(300.0, 2, 2, 2, 1)]


def test_each_prefix_holds_what_comes_before_its_block():
    body = messages_request()
    tools, system, last = (prefix_of(body, bp) for bp in breakpoints(body))
    assert [t["name"] for t in tools["tools"]] == ["a", "b"]
    assert "system" not in tools and tools["messages"] == []
    assert system["system"] == body["system"] and system["messages"] == []
    assert last["messages"][:2] == body["messages"][:2]
    assert last["messages"][2]["content"] == body["messages"][2]["content"][:1]
    assert "cache_control" not in last and last["model"] == "m"


def test_a_request_level_mark_covers_the_whole_prompt():
    body = {"model": "m", "cache_control": EPH,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "yo"},
                         {"role": "user", "content": [{"type": "text", "text": "x"},
                                                      {"type": "text", "text": "y"}]}]}
    (bp,) = breakpoints(body)
    assert prefix_of(body, bp)["messages"] == body["messages"]


def test_chat_content_parts_carry_marks_too():
    body = {"messages": [{"role": "system", "content": [
        {"type": "text", "text": "sys", "cache_control": EPH}]},
        {"role": "user", "content": "hi"}]}
    (bp,) = breakpoints(body)
    assert prefix_of(body, bp)["messages"] == body["messages"][:1]


def test_an_unmarked_request_has_no_breakpoints():
    assert breakpoints({"messages": [{"role": "user", "content": "hi"}]}) == []


@pytest.mark.parametrize("mark, words", [
    ({"type": "persistent"}, "ephemeral"), ({"type": "ephemeral", "ttl": "10m"}, "ttl"),
    ("yes", "ephemeral")])
def test_a_malformed_mark_names_where_and_why(mark, words):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                       "cache_control": mark}]}]}
    with pytest.raises(CacheControlError, match=r"messages\[0\]\.content\[0\]") as e:
        breakpoints(body)
    assert words in str(e.value)


def test_five_breakpoints_are_refused_as_anthropic_does():
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": str(i), "cache_control": EPH} for i in range(5)]}]}
    with pytest.raises(CacheControlError, match="maximum of 4"):
        breakpoints(body)


def test_a_salt_changes_every_block_and_no_salt_is_the_plain_chain():
    tokens = list(range(64))
    plain = block_hash_chain(tokens, 16)
    assert salted_root(None) == salted_root("") == ROOT_HASH
    a = block_hash_chain(tokens, 16, parent=salted_root("tenant-a"))
    b = block_hash_chain(tokens, 16, parent=salted_root("tenant-b"))
    assert len({*plain, *a, *b}) == 12
    assert a == block_hash_chain(tokens, 16, parent=salted_root("tenant-a"))
