"""The cache contract (#41) in front of real vLLM: `cache_salt` is vLLM's own field, so the
gateway's per-tenant salts must divide vLLM's prefix cache, its salted KV events must land in
the gateway's index under the chain the gateway computes for that tenant, and the router's
predicted cached tokens must agree with what vLLM reports (the parity metric).

vLLM publishes a salted prompt's first block with `extra_keys: [[salt]]` and caches 128-token
blocks; the gateway keys 16-token ones (tests/vllm/test_kv_events_vllm.py)."""
from __future__ import annotations

import re

import aiohttp
import pytest

from prefixgate.proxy.testing.vllm_install import prepare_model
from tests.plugins.helpers import follow_up, metrics, sample, until, up
from tests.vllm.conftest import SERVED_NAME
from tests.vllm.test_kv_events_vllm import ROUTE, SETTLE_S, stored, system_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TENANT_KEYS = {"a": "sk-contract-tenant-a-01", "b": "sk-contract-tenant-b-02"}


async def chat(client, gw, tenant: str, messages) -> tuple[str, str, int]:
    """(upstream, route outcome, vLLM's cached tokens) of one chat through the gateway as
    `tenant`."""
    async with client.post(gw.url + "/v1/chat/completions",
                           headers={"Authorization": f"Bearer {TENANT_KEYS[tenant]}"},
                           json={"model": SERVED_NAME, "messages": messages,
                                 "max_tokens": 1, "temperature": 0}) as r:
        body = await r.json()
        assert r.status == 200, body
        outcome = re.search(r"outcome=(\w+)", r.headers["x-prefixgate-route"]).group(1)
        cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        return r.headers["x-prefixgate-upstream"], outcome, cached


@pytest.fixture
async def tenants_gateway(vllm_pair, make_gateway):
    """`await tenants_gateway(isolation)`: a gateway with the two tenants' keys in front of
    both servers, routing by their KV events."""
    async def factory(isolation: dict | None = None):
        raw = {"upstreams": [{"name": f"vllm{i}", "url": s.url, "kv_events": s.kv_events}
                             for i, s in enumerate(vllm_pair)],
               "model": {"tokenizer": str(prepare_model())},
               "auth": {"api_keys": list(TENANT_KEYS.values())},
               "plugins": [{"prerender": {}}, {"prefix_route": ROUTE}]}
        if isolation is not None:
            raw["isolation"] = isolation
        return await make_gateway(raw)
    return factory


async def test_per_key_salts_divide_vllms_cache_and_route_each_tenant_home(tenants_gateway):
    gw = await tenants_gateway()                 # per_key: the default with api_keys
    doc = system_prompt("contract-secret")
    async with aiohttp.ClientSession() as client:
        before = await until(client, gw, lambda m: up(m, "vllm0") and up(m, "vllm1"),
                             SETTLE_S)
        home, _, _ = await chat(client, gw, "a", doc)
        # vLLM's salted events reach the index under a's salted chain: a's follow-up is
        # routed home on them and vLLM serves its prefix from cache
        first = await stored(client, gw, home, before)
        upstream, outcome, cached = await chat(client, gw, "a", follow_up(doc))
        assert (upstream, outcome) == (home, "cache")
        assert cached >= 3 * 128
        # b's identical follow-up: nothing of a's is b's, in the index or in vLLM
        _, b_outcome, b_cached = await chat(client, gw, "b", follow_up(doc))
        assert b_outcome != "cache" and b_cached == 0
        after = await metrics(client, gw)
    # the router predicted what vLLM reported for a's follow-up (its keys are vLLM's)
    agreed = [sample(m, "prefixgate_route_cache_predictions_total", upstream=home,
                     model=SERVED_NAME, outcome="agree") for m in (first, after)]
    assert agreed[1] > agreed[0]
    for outcome in ("hit_none", "none_hit"):
        assert sample(after, "prefixgate_route_cache_predictions_total", upstream=home,
                      model=SERVED_NAME, outcome=outcome) == 0


async def test_a_shared_cache_lets_one_tenant_hit_anothers_prefix(tenants_gateway):
    gw = await tenants_gateway({"cache": "shared"})
    doc = system_prompt("contract-shared")
    async with aiohttp.ClientSession() as client:
        before = await until(client, gw, lambda m: up(m, "vllm0") and up(m, "vllm1"),
                             SETTLE_S)
        home, _, _ = await chat(client, gw, "a", doc)
        await stored(client, gw, home, before)
        upstream, outcome, cached = await chat(client, gw, "b", follow_up(doc))
    assert (upstream, outcome) == (home, "cache") and cached >= 3 * 128


async def test_messages_are_salted_per_tenant_on_vllm_too(tenants_gateway):
    """vLLM's /v1/messages takes `cache_salt` as well: a tenant's second turn reads its first
    from cache (`cache_read_input_tokens`), another tenant's identical one reads nothing."""
    gw = await tenants_gateway()
    system = system_prompt("contract-messages")[0]["content"]
    body = {"model": SERVED_NAME, "max_tokens": 1, "system": system,
            "messages": [{"role": "user", "content": "first question"}]}
    read = {}
    async with aiohttp.ClientSession() as client:
        for tenant in ("a", "a", "b"):
            async with client.post(gw.url + "/v1/messages", json=body, headers={
                    "x-api-key": TENANT_KEYS[tenant], "anthropic-version": "2023-06-01",
                    "x-session-id": "contract-messages"}) as r:
                answer = await r.json()
                assert r.status == 200, answer
                read.setdefault(tenant, []).append(answer["usage"]["cache_read_input_tokens"])
    assert read["a"][1] >= 3 * 128 and read["b"] == [0]
