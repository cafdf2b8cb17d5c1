"""Per-key limits on requests and tokens per minute, through real gateways in front of a
stand-in: counted per replica (a 1/N share each with `replicas: N`) or across replicas in a
real `redis-server` (Debian's package, which .ci/run installs), through a Redis restart and a
Redis that is down; OpenAI's `x-ratelimit-*` headers on every answer of a limited key."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from prefixgate.common.runtime import free_port
from prefixgate.common.schema import ConfigError
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.rate_limits import duration
from tests.helpers import assert_openai_error, whole_minute_ahead

KEY, OTHER = "sk-limited-0123456789", "sk-other-0123456789"
MODEL = "standin-model"


def config(standin, limit: dict, **rate_limits) -> dict:
    if "store" in rate_limits:      # a loaded test machine: Redis's answer may take a while
        rate_limits.setdefault("store_timeout_ms", 2000)
    return {"upstreams": [{"name": "a", "url": standin.url}],
            "auth": {"api_keys": [{"key": KEY, "name": "team", "rate_limit": limit}, OTHER]},
            "rate_limits": rate_limits}


async def ask(client, gw, key: str = KEY, stream: bool = False, words: int = 40):
    """(status, body, headers) of one chat; a stream is read to its end."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * words}],
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with client.post(gw.url + "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as r:
        raw = await r.read()
        return r.status, (await r.json() if not stream or r.status != 200 else raw), r.headers


async def test_tokens_per_minute_counts_usage_and_refuses_the_overrun(make_standin,
                                                                        make_gateway):
    standin = await make_standin(tokens=5)
    gw = await make_gateway(config(standin, {"tokens_per_minute": 150}))
    async with aiohttp.ClientSession() as client:
        spent = []
        for stream in (False, True, False):     # each: 40 words of prompt + 5 tokens
            status, _, h = await ask(client, gw, stream=stream)
            assert status == 200
            assert h["x-ratelimit-limit-tokens"] == "150"
            spent.append(int(h["x-ratelimit-remaining-tokens"]))
            await asyncio.sleep(0.05)           # the stream's usage is charged at its end
        # the budget fell by each answer's usage (a stream's from its final usage event)
        per_request = spent[0] - spent[1]
        assert per_request > 40 and spent[1] - spent[2] in (per_request, per_request - 1)
        status, body, h = await ask(client, gw)
        assert status == 429, (spent, status)
        assert_openai_error(body, 429, status)
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert int(h["Retry-After"]) >= 1 and h["x-ratelimit-remaining-tokens"] == "0"
        assert "x-ratelimit-limit-requests" not in h     # only tokens are limited
        assert (await ask(client, gw, OTHER))[0] == 200  # other keys are not limited
    assert len(standin.requests) == 4


async def test_without_a_store_each_replica_allows_its_share(make_standin, make_gateway):
    standin = await make_standin(tokens=1)
    limit = {"requests_per_minute": 600, "burst": 3}
    replicas = [await make_gateway(config(standin, limit, replicas=2)) for _ in range(2)]
    async with aiohttp.ClientSession() as client:
        for gw in replicas:
            statuses = [await ask(client, gw, words=2) for _ in range(4)]
            assert [s for s, _, _ in statuses] == [200, 200, 200, 429]
            assert statuses[0][2]["x-ratelimit-limit-requests"] == "300"
            assert [h["x-ratelimit-remaining-requests"] for _, _, h in statuses] == \
                ["2", "1", "0", "0"]
            assert statuses[0][2]["x-ratelimit-reset-requests"] == duration(0.3)


async def test_replicas_share_one_budget_in_redis(make_standin, make_gateway, redis_server):
    standin = await make_standin(tokens=1)
    limit = {"requests_per_minute": 5}
    one, two = (await make_gateway(config(standin, limit, store=redis_server.url)),
                await make_gateway(config(standin, limit, store=redis_server.url)))
    whole_minute_ahead()
    async with aiohttp.ClientSession() as client:
        answers = [await ask(client, gw, words=2) for gw in (one, two, one, two, one, two)]
    assert [s for s, _, _ in answers] == [200] * 5 + [429]
    assert [h["x-ratelimit-remaining-requests"] for _, _, h in answers] == \
        ["4", "3", "2", "1", "0", "0"]
    reset = answers[-1][2]
    assert 1 <= int(reset["Retry-After"]) <= 60
    assert reset["x-ratelimit-reset-requests"].endswith("s")


async def test_a_token_budget_charged_on_one_replica_holds_on_another(
        make_standin, make_gateway, redis_server):
    standin = await make_standin(tokens=5)
    limit = {"tokens_per_minute": 60}
    one = await make_gateway(config(standin, limit, store=redis_server.url))
    two = await make_gateway(config(standin, limit, store=redis_server.url))
    whole_minute_ahead()
    async with aiohttp.ClientSession() as client:
        assert (await ask(client, one, stream=True))[0] == 200      # ~45 tokens
        await asyncio.sleep(0.1)
        status, _, h = await ask(client, two)                      # under 60: admitted
        assert status == 200 and int(h["x-ratelimit-remaining-tokens"]) < 20
        await asyncio.sleep(0.1)
        status, body, _ = await ask(client, two)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"


async def test_a_redis_restart_loses_counts_not_requests(make_standin, make_gateway,
                                                         redis_server, caplog):
    standin = await make_standin(tokens=1)
    gw = await make_gateway(config(standin, {"requests_per_minute": 3},
                                   store=redis_server.url))
    whole_minute_ahead(15)
    caplog.set_level(logging.WARNING, "prefixgate.rate_limits")
    async with aiohttp.ClientSession() as client:
        assert [(await ask(client, gw, words=2))[0] for _ in range(4)] == [200, 200, 200, 429]
        redis_server.stop()
        down = [await ask(client, gw, words=2) for _ in range(3)]   # fails open, no 5xx
        redis_server.start()                                        # empty: counting anew
        back = [(await ask(client, gw, words=2))[0] for _ in range(4)]
    assert [s for s, _, _ in down] == [200, 200, 200]
    assert all("x-ratelimit-limit-requests" not in h for _, _, h in down)
    assert back == [200, 200, 200, 429]
    warnings = [r for r in caplog.records if "rate limit store unavailable" in r.message]
    assert len(warnings) == 1 and "let through" in warnings[0].message    # once a minute


async def test_a_redis_that_is_down_refuses_when_closed(make_standin, make_gateway):
    standin = await make_standin(tokens=1)
    down = f"redis://127.0.0.1:{free_port()}/0"          # nothing listens there
    gw = await make_gateway(config(standin, {"requests_per_minute": 100}, store=down,
                                   on_store_error="closed"))
    async with aiohttp.ClientSession() as client:
        status, body, h = await ask(client, gw, words=2)
        assert (await ask(client, gw, OTHER, words=2))[0] == 200    # an unlimited key
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert h["Retry-After"] == "1"
    assert len(standin.requests) == 1


async def test_per_model_budgets(make_standin, make_gateway):
    small, big = await make_standin(model="small"), await make_standin(model="big")
    gw = await make_gateway({
        "upstreams": [{"name": "s", "url": small.url}, {"name": "b", "url": big.url}],
        "auth": {"api_keys": [{"key": KEY, "rate_limit": {"requests_per_minute": 60,
                                                          "burst": 1, "per_model": True}}]}})
    async with aiohttp.ClientSession() as client:
        async def status(model):
            async with client.post(gw.url + "/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {KEY}"}) as r:
                return r.status
        assert [await status(m) for m in ("small", "big", "small", "big")] == \
            [200, 200, 429, 429]


@pytest.mark.parametrize("raw, error", [
    ({"rate_limits": {"store": "http://127.0.0.1:6379"}},
     "rate_limits.store: must be a redis://host:port/db URL"),
    ({"rate_limits": {"replicas": 0}}, "rate_limits.replicas: must be > 0"),
    ({"rate_limits": {"on_store_error": "maybe"}}, "rate_limits.on_store_error: must be one of"),
    ({"auth": {"api_keys": [{"key": KEY, "rate_limit": {"tokens_per_minute": 0}}]}},
     "auth.api_keys[0].rate_limit.tokens_per_minute: must be > 0"),
    ({"auth": {"api_keys": [KEY], "rate_limit": {"tokens_per_hour": 5}}},
     "auth.rate_limit.tokens_per_hour: unknown key"),
])
def test_bad_limits_fail_at_start_naming_the_key(raw, error):
    with pytest.raises(ConfigError) as e:
        validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}], **raw})
    assert str(e.value).startswith(error), str(e.value)


def test_reset_durations_read_like_openais():
    assert [duration(s) for s in (0, 0.2, 17, 60, 360, 3723)] == \
        ["0s", "1s", "17s", "1m0s", "6m0s", "1h2m3s"]
