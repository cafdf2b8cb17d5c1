"""Bad input and failing upstreams get OpenAI-shaped errors with the right status."""
from __future__ import annotations

import socket

import aiohttp
import pytest

from tests.helpers import CHAT, assert_openai_error


def dead_url() -> str:
    """A loopback port with nothing listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def post(url, **kw):
    async with aiohttp.ClientSession() as client:
        async with client.post(url, **kw) as r:
            return r.status, await r.json(content_type=None), r.headers


@pytest.mark.parametrize("data,why", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"", "not valid JSON"),
])
async def test_malformed_body_is_400(gateway, standin, data, why):
    status, payload, _ = await post(gateway.url + "/v1/chat/completions", data=data,
                                    headers={"Content-Type": "application/json"})
    assert_openai_error(payload, 400, status)
    assert why in payload["error"]["message"]
    assert standin.requests == []          # nothing malformed is sent on


async def test_unknown_path_404_and_wrong_method_405(gateway):
    async with aiohttp.ClientSession() as client:
        async with client.get(gateway.url + "/v1/nothing") as r:
            assert_openai_error(await r.json(), 404, r.status)
        async with client.get(gateway.url + "/v1/chat/completions") as r:
            assert_openai_error(await r.json(), 405, r.status)


async def test_oversized_body_is_413(make_gateway, standin):
    gw = await make_gateway({"upstreams": [{"url": standin.url}],
                             "limits": {"max_body_bytes": 1000}})
    status, payload, _ = await post(gw.url + "/v1/chat/completions",
                                    json={**CHAT, "pad": "x" * 2000})
    assert_openai_error(payload, 413, status)
    assert "max_body_bytes" in payload["error"]["message"]


async def test_refused_upstream_is_502(make_gateway):
    gw = await make_gateway({"upstreams": [{"name": "dead", "url": dead_url()}]})
    status, payload, headers = await post(gw.url + "/v1/chat/completions", json=CHAT)
    assert_openai_error(payload, 502, status)
    assert headers["x-prefixgate-upstream"] == "dead"


async def test_reset_before_first_byte_is_502(make_standin, make_gateway):
    up = await make_standin(fail="reset_after", fail_after=0)
    gw = await make_gateway({"upstreams": [{"url": up.url}], "retries": 0})
    status, payload, _ = await post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert_openai_error(payload, 502, status)
    assert len(up.requests) == 1


async def test_first_byte_timeout_is_504(make_standin, make_gateway):
    up = await make_standin(fail="hang")
    gw = await make_gateway({"upstreams": [{"url": up.url, "timeouts": {"first_byte": 0.3}}]})
    status, payload, _ = await post(gw.url + "/v1/chat/completions", json=CHAT)
    assert_openai_error(payload, 504, status)
    assert "0.3" in payload["error"]["message"]


async def test_failover_to_a_healthy_upstream_before_the_first_byte(make_standin, make_gateway):
    up = await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "dead", "url": dead_url()},
                                           {"name": "live", "url": up.url}],
                             "plugins": ["round_robin"]})
    for _ in range(6):
        status, payload, headers = await post(gw.url + "/v1/chat/completions", json=CHAT)
        assert status == 200, payload
        assert headers["x-prefixgate-upstream"] == "live"
    assert len(up.requests) == 6


async def test_upstream_error_status_passes_through(make_standin, make_gateway):
    up = await make_standin(fail="status", status=400)
    gw = await make_gateway({"upstreams": [{"url": up.url}]})
    status, payload, _ = await post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert_openai_error(payload, 400, status)


async def test_gateway_survives_a_burst_of_bad_requests(gateway):
    async with aiohttp.ClientSession() as client:
        for data in [b"{", b"null", b"[]", b"1e999999", b'{"stream": true', b"\x00" * 50]:
            async with client.post(gateway.url + "/v1/completions", data=data) as r:
                assert 400 <= r.status < 500
        async with client.post(gateway.url + "/v1/completions", json={"prompt": "ok"}) as r:
            assert r.status == 200
