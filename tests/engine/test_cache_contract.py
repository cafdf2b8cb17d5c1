"""The cache contract on the bundled engine over HTTP (the demo model, real servers on loopback,
the `openai` and `anthropic` SDKs as clients):
- `cache_salt` on /v1/chat/completions, /v1/completions and /v1/messages: equal salts share
  cached tokens, other salts (or none) do not; a bad salt gets vLLM's 400 as JSON (Anthropic's
  shape on /v1/messages);
- `cache_control`: a marked prefix survives a flood of other prompts that overflows the KV
  cache, while an unmarked prefix of the same length sent with it is evicted; usage as Anthropic
  reports it (cache_creation_input_tokens, cache_read_input_tokens) and as vLLM does
  (prompt_tokens_details.created_cache_tokens); malformed marks are 400s;
- /metrics: pinned blocks and their expiries.
"""
from __future__ import annotations

import random
import uuid

import aiohttp
import anthropic
import openai
import pytest

from tests.engine.helpers import metrics
from tests.helpers import ServerThread

BLOCK = 16
GREEDY = {"temperature": 0}
GENERATION_PROMPT = 8        # tokens the chat template adds to open the answer, at most
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from old oak "
         "trees near river banks where children play games and sing songs about distant "
         "mountains green valleys bright stars and long summer evenings").split()


def text(words: int, seed: int) -> str:
    """English-looking text no earlier request sent (a fresh tag first)."""
    rng = random.Random(seed)
    return uuid.uuid4().hex + " " + " ".join(rng.choice(WORDS) for _ in range(words))


def serve(kv_blocks: int) -> ServerThread:
    return ServerThread(["--model", "demo", "--block-size", str(BLOCK),
                         "--num-kv-blocks", str(kv_blocks), "--served-model-name", "demo"])


@pytest.fixture(scope="module")
def server():
    with serve(256) as s:
        yield s


@pytest.fixture
def chat(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def client(server):
    return anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)


def marked(body: str, ttl: str | None = None) -> list[dict]:
    mark = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": body, "cache_control": mark}]


# --- cache_salt -------------------------------------------------------------------------------

async def test_equal_salts_share_cached_tokens_and_other_salts_do_not(chat):
    messages = [{"role": "system", "content": text(120, 1)}, {"role": "user", "content": "Hi"}]

    async def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        r = await chat.chat.completions.create(model="demo", messages=messages, max_tokens=2,
                                               extra_body={**GREEDY, **extra})
        return r.usage.prompt_tokens_details.cached_tokens

    assert await cached("tenant-a") == 0
    shared = await cached("tenant-a")
    assert shared > 0 and shared % BLOCK == 0
    assert await cached("tenant-b") == 0
    assert await cached(None) == 0              # no salt is a salt of its own
    assert await cached(None) == shared
    assert await cached("tenant-b") == shared


async def test_completions_and_messages_take_the_salt(chat, client):
    prompt = text(120, 2)
    got = []
    for salt in ("x", "x", "y"):
        r = await chat.completions.create(model="demo", prompt=prompt, max_tokens=2,
                                          extra_body={**GREEDY, "cache_salt": salt})
        got.append(r.usage.prompt_tokens_details.cached_tokens)
    assert got[0] == got[2] == 0 and got[1] > 0
    kwargs = dict(model="demo", max_tokens=2, system=text(120, 3),
                  messages=[{"role": "user", "content": "Hi"}])
    reads = [(await client.messages.create(**kwargs, extra_body={**GREEDY, "cache_salt": s})
              ).usage.cache_read_input_tokens for s in ("x", "x", "y")]
    assert reads[0] == reads[2] == 0 and reads[1] > 0


EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided."
SHAPE = ("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
         "'\\\\', or NUL.")


@pytest.mark.parametrize("salt,message", [
    ("", EMPTY), (5, EMPTY), (["a"], EMPTY), ("x" * 129, SHAPE), ("a/b", SHAPE), ("a@b", SHAPE),
    ("a\\b", SHAPE), ("a\x00b", SHAPE)])
async def test_a_bad_salt_gets_vllms_400_as_json(server, salt, message):
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        for path, body in (("/v1/chat/completions", chat),
                           ("/v1/completions", {"model": "demo", "prompt": "Hi"})):
            async with s.post(server.url + path, json={**body, "cache_salt": salt}) as r:
                assert r.status == 400
                assert await r.json() == {"error": {"message": message, "type": "Bad Request",
                                                    "param": "cache_salt", "code": 400}}
        async with s.post(server.url + "/v1/messages", json={**chat, "cache_salt": salt}) as r:
            assert r.status == 400
            assert await r.json() == {"type": "error", "error": {
                "type": "invalid_request_error", "message": message}}
    assert len("x" * 128) == 128        # the longest a salt may be:
    async with aiohttp.ClientSession() as s, s.post(
            server.url + "/v1/completions",
            json={"model": "demo", "prompt": "Hi", "max_tokens": 1, "cache_salt": "x" * 128}) as r:
        assert r.status == 200


# --- usage as Anthropic and vLLM report it ----------------------------------------------------

async def test_messages_usage_reports_cache_creation_then_reads(client):
    kwargs = dict(model="demo", max_tokens=2, system=marked(text(150, 4)),
                  messages=[{"role": "user", "content": "What now?"}])
    total = (await client.messages.count_tokens(**{k: v for k, v in kwargs.items()
                                                   if k != "max_tokens"})).input_tokens
    first = (await client.messages.create(**kwargs, extra_body=GREEDY)).usage
    created = first.cache_creation_input_tokens
    assert created > 0 and created % BLOCK == 0 and first.cache_read_input_tokens == 0
    assert first.input_tokens + created == total
    async with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        second = (await stream.get_final_message()).usage
    assert second.cache_read_input_tokens >= created
    assert second.cache_creation_input_tokens == 0
    assert second.input_tokens + second.cache_read_input_tokens == total
    plain = (await client.messages.create(model="demo", max_tokens=2, system=text(150, 5),
                                          messages=kwargs["messages"], extra_body=GREEDY)).usage
    assert plain.cache_creation_input_tokens is None     # no mark: as before (vLLM's omission)


async def test_the_marked_prefix_ends_at_its_breakpoint(client):
    system = text(150, 6)
    question = [{"role": "user", "content": text(60, 7)}]
    whole = await client.messages.create(model="demo", max_tokens=2, extra_body=GREEDY,
                                         system=[{"type": "text", "text": system}],
                                         messages=question,
                                         cache_control={"type": "ephemeral"})
    # request-level (the SDK 2.x's automatic caching): the whole conversation — all the
    # prompt but the generation prompt's few tokens (GENERATION_PROMPT at most) — floored to
    # whole blocks (the fresh tag's token count varies, so where the floor falls does too)
    total = whole.usage.input_tokens + whole.usage.cache_creation_input_tokens
    created = whole.usage.cache_creation_input_tokens
    assert created % BLOCK == 0 and total - GENERATION_PROMPT - BLOCK < created <= total
    head = await client.messages.create(model="demo", max_tokens=2, extra_body=GREEDY,
                                        system=marked(text(150, 8)), messages=question)
    # the system block alone: fewer tokens than the prompt's, the question's not among them
    assert 0 < head.usage.cache_creation_input_tokens <= total - 60


async def test_chat_content_parts_with_cache_control_report_created_cache_tokens(chat):
    messages = [{"role": "system", "content": marked(text(150, 9))},
                {"role": "user", "content": "Hi"}]
    first = await chat.chat.completions.create(model="demo", messages=messages, max_tokens=2,
                                               extra_body=GREEDY)
    details = first.usage.prompt_tokens_details.model_dump()
    assert details["cached_tokens"] == 0 and details["created_cache_tokens"] > 0
    again = await chat.chat.completions.create(model="demo", messages=messages, max_tokens=2,
                                               extra_body=GREEDY)
    details_again = again.usage.prompt_tokens_details.model_dump()
    assert details_again["created_cache_tokens"] == 0
    assert details_again["cached_tokens"] >= details["created_cache_tokens"]
    plain = await chat.chat.completions.create(
        model="demo", max_tokens=2, extra_body=GREEDY,
        messages=[{"role": "user", "content": text(50, 10)}])
    assert "created_cache_tokens" not in plain.usage.prompt_tokens_details.model_dump(
        exclude_unset=True)


@pytest.mark.parametrize("system,message", [
    (marked("x", ttl="2m"), "system[0].cache_control.ttl: expected one of ['1h', '5m']"),
    ([{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}],
     "system[0].cache_control: expected"),
    (marked("x") * 5, "A maximum of 4 blocks with cache_control may be provided. Found 5.")])
async def test_a_malformed_cache_control_is_a_400(client, system, message):
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(model="demo", max_tokens=2, system=system,
                                     messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert message in e.value.body["error"]["message"]


# --- metrics ----------------------------------------------------------------------------------

async def test_metrics_show_pinned_blocks_and_their_expiries(client, server):
    usage = (await client.messages.create(
        model="demo", max_tokens=2, system=marked(text(150, 11), ttl="1h"),
        messages=[{"role": "user", "content": "Hi"}], extra_body=GREEDY)).usage
    async with aiohttp.ClientSession() as s:
        m = await metrics(s, server.url)
    assert m["prefixgate:cache_pinned_blocks"] >= usage.cache_creation_input_tokens // BLOCK > 0
    assert 3590 < m["prefixgate:cache_pin_latest_expiry_seconds"] <= 3600
    assert 0 < m["prefixgate:cache_pin_soonest_expiry_seconds"] <= 3600
    assert m["prefixgate:cache_pin_dropped_blocks_total"] == 0


# --- a flood that overflows the KV cache ------------------------------------------------------

KV_BLOCKS = 48          # 768 tokens; the cap lets pins hold 24 blocks


@pytest.fixture(scope="module")
def small():
    with serve(KV_BLOCKS) as s:
        yield s


async def test_a_marked_prefix_survives_a_flood_that_evicts_an_unmarked_one(small):
    client = anthropic.AsyncAnthropic(base_url=small.url, api_key="unused", max_retries=0)

    async def turn(system, *texts: str):
        history = []
        for i, t in enumerate(texts):
            history += [{"role": "user", "content": t}] if i % 2 == 0 else [
                {"role": "assistant", "content": t}]
        return (await client.messages.create(model="demo", max_tokens=2, system=system,
                                             messages=history, extra_body=GREEDY)).usage

    body_a, body_b = text(150, 12), text(150, 13)
    first = await turn(marked(body_a), "Turn one.")
    unmarked = await turn([{"type": "text", "text": body_b}], "Turn one.")
    pinned = first.cache_creation_input_tokens
    assert pinned >= 8 * BLOCK and unmarked.cache_creation_input_tokens is None
    flood = 0
    for i in range(6):      # 6 prompts of ~20 blocks through the ~24 blocks pins leave
        flood += (await turn(text(220, 100 + i), "Go on.")).input_tokens
    assert flood > KV_BLOCKS * BLOCK * 2
    again_a = await turn(marked(body_a), "Turn one.", "Sure.", "Turn two.")
    again_b = await turn([{"type": "text", "text": body_b}], "Turn one.", "Sure.", "Turn two.")
    assert again_a.cache_read_input_tokens >= pinned
    assert again_b.cache_read_input_tokens == 0
    async with aiohttp.ClientSession() as s:
        m = await metrics(s, small.url)
    assert m["prefixgate:cache_pin_dropped_blocks_total"] == 0
