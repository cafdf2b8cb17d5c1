"""vLLM's endpoints beyond chat and completions, through the gateway: /tokenize and
/detokenize, the Responses API (follow-ups with `previous_response_id` and reads by id go back
to the server that holds the response), and, as `passthrough:` paths, Anthropic's /v1/messages
and vLLM's render endpoints."""
from __future__ import annotations

import json

import aiohttp
import pytest

from prefixgate.common import sse
from tests.vllm.conftest import SERVED_NAME
from tests.vllm.helpers import QUESTION, send, stable, through_and_direct, upstreams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PASSTHROUGH = ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions/render",
               "/v1/completions/render"]


@pytest.fixture
async def gw(vllm_pair, make_gateway):
    return await make_gateway({"upstreams": upstreams(vllm_pair), "passthrough": PASSTHROUGH})


async def test_tokenize_and_detokenize(vllm_pair, gw):
    async with aiohttp.ClientSession() as client:
        for body in ({"model": SERVED_NAME, "prompt": "Hello 123"},
                     {"model": SERVED_NAME, "prompt": "Hello 123", "return_token_strs": True},
                     {"model": SERVED_NAME, "messages": QUESTION}):
            proxied, direct = await through_and_direct(client, gw, vllm_pair, "/tokenize", body)
            assert proxied.status == 200 and proxied.raw == direct.raw
        tokens = json.loads((await send(client, gw.url, "/tokenize", {
            "model": SERVED_NAME, "prompt": "Hello 123"})).raw)["tokens"]
        back = await send(client, gw.url, "/detokenize", {"model": SERVED_NAME, "tokens": tokens})
    assert tokens == [19556, 216, 33, 34, 35]
    assert json.loads(back.raw) == {"prompt": "Hello 123"}


async def test_responses_follow_ups_and_reads_go_to_their_server(vllm_pair, gw):
    ask = {"model": SERVED_NAME, "max_output_tokens": 8, "temperature": 0}
    async with aiohttp.ClientSession() as client:
        first = await send(client, gw.url, "/v1/responses",
                           {**ask, "input": "What is the capital of France?"})
        assert first.status == 200, first.raw
        home, last = first.headers["x-prefixgate-upstream"], json.loads(first.raw)
        assert last["output"][0]["content"][0]["text"] == "The capital of France is Paris."
        for question in ("And of Italy?", "And of Spain?"):
            answer = await send(client, gw.url, "/v1/responses", {
                **ask, "input": question, "previous_response_id": last["id"]})
            assert answer.status == 200, answer.raw
            assert answer.headers["x-prefixgate-upstream"] == home
            previous, last = last, json.loads(answer.raw)
            assert last["previous_response_id"] == previous["id"]
        read = await send(client, gw.url, f"/v1/responses/{previous['id']}")
        assert read.status == 200 and read.headers["x-prefixgate-upstream"] == home
        assert json.loads(read.raw)["id"] == previous["id"]
        missing = await send(client, gw.url, "/v1/responses", {
            **ask, "input": "x", "previous_response_id": "resp_nope"})
        assert missing.status == 404
        assert json.loads(missing.raw)["error"] == {
            "message": "Response with id 'resp_nope' not found.",
            "type": "invalid_request_error", "param": "response_id", "code": 404}


def response_events(raw: bytes) -> list[tuple[str, dict]]:
    """(event name, its data) of a Responses API stream."""
    events = []
    for event in raw.split(b"\n\n"):
        if event:
            name, data = event.split(b"\n", 1)
            events.append((name.removeprefix(b"event: ").decode(),
                           json.loads(data.removeprefix(b"data: "))))
    return events


def without_deltas(events: list[tuple[str, dict]]) -> list[tuple[str, bytes]]:
    """The events but their text deltas, numbers, ids and times."""
    return [(kind, stable(json.dumps({k: v for k, v in data.items() if k != "sequence_number"},
                                     separators=(",", ":")).encode()))
            for kind, data in events if kind != "response.output_text.delta"]


async def test_a_streamed_response_is_relayed_and_remembered(vllm_pair, gw):
    body = {"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 3, "temperature": 0,
            "stream": True}
    async with aiohttp.ClientSession() as client:
        proxied, direct = await through_and_direct(client, gw, vllm_pair, "/v1/responses", body)
        assert proxied.status == 200
        events, direct_events = response_events(proxied.raw), response_events(direct.raw)
        # vLLM joins text deltas as they come, so only the rest of the stream must match
        assert without_deltas(events) == without_deltas(direct_events)
        assert [kind for kind, _ in events][:2] == ["response.created", "response.in_progress"]
        done = events[-1][1]["response"]
        assert done["status"] == "incomplete"
        assert done["incomplete_details"] == {"reason": "max_output_tokens"}
        read = await send(client, gw.url, f"/v1/responses/{done['id']}")
    assert read.status == 200
    assert read.headers["x-prefixgate-upstream"] == proxied.headers["x-prefixgate-upstream"]


def message_events(raw: bytes) -> tuple[list[bytes], str]:
    """A Messages stream's events but its text deltas (ids blanked), and the text they make."""
    events, text = [], []
    for event in sse.events_in([raw]):
        data = sse.json_of(event)
        if isinstance(data, dict) and data.get("type") == "content_block_delta":
            text.append(data["delta"].get("text", ""))
        else:
            events.append(stable(event))
    return events, "".join(text)


async def test_anthropic_messages_pass_through(vllm_pair, gw):
    body = {"model": SERVED_NAME, "max_tokens": 8, "temperature": 0, "messages": QUESTION}
    async with aiohttp.ClientSession() as client:
        whole, direct = await through_and_direct(client, gw, vllm_pair, "/v1/messages", body)
        assert whole.status == 200 and stable(whole.raw) == stable(direct.raw)
        assert json.loads(whole.raw)["content"] == [
            {"type": "text", "text": "The capital of France is Paris."}]
        streamed, direct = await through_and_direct(client, gw, vllm_pair, "/v1/messages",
                                                    {**body, "stream": True})
        # vLLM joins text deltas as they come (as in the Responses stream above): the rest of
        # the stream, and the text the deltas make, must match
        assert streamed.status == 200
        assert message_events(streamed.raw) == message_events(direct.raw)
        assert streamed.raw.rstrip().endswith(b'data: {"type":"message_stop"}')
        count = await send(client, gw.url, "/v1/messages/count_tokens",
                           {"model": SERVED_NAME, "messages": QUESTION})
    assert json.loads(count.raw)["input_tokens"] == json.loads(whole.raw)["usage"][
        "input_tokens"]


async def test_render_endpoints_pass_through(vllm_pair, gw):
    async with aiohttp.ClientSession() as client:
        for path, body in (("/v1/chat/completions/render",
                            {"model": SERVED_NAME, "messages": QUESTION}),
                           ("/v1/completions/render",
                            {"model": SERVED_NAME, "prompt": "Hello 123"})):
            proxied, direct = await through_and_direct(client, gw, vllm_pair, path, body)
            assert proxied.status == 200 and stable(proxied.raw) == stable(direct.raw)
            rendered = json.loads(proxied.raw)
            if isinstance(rendered, list):          # completions: one per prompt
                (rendered,) = rendered
            tokens = json.loads((await send(client, gw.url, "/tokenize", body)).raw)["tokens"]
            assert rendered["token_ids"] == tokens
