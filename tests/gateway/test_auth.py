"""API keys, credentials upstream, rate limits, request limits, no open proxy, admin address."""
from __future__ import annotations

import asyncio
import hashlib
import json

import aiohttp
import pytest

from prefixgate.common.runtime import start_app
from prefixgate.common.schema import ConfigError
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config import gateway as config_mod
from tests.helpers import CHAT, assert_openai_error

KEY, OTHER = "sk-gateway-key-1", "sk-gateway-key-2"
HASHED = "sk-only-the-hash-is-stored"


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


async def post(url, headers=None, **kw):
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", headers=headers or {},
                               **(kw or {"json": CHAT})) as r:
            return r.status, await r.json(content_type=None), r.headers


@pytest.fixture
async def authed(make_gateway, standin):
    return await make_gateway({"upstreams": [{"name": "a", "url": standin.url}], "auth": {
        "api_keys": [KEY,
                     {"key": "sha256:" + hashlib.sha256(HASHED.encode()).hexdigest(),
                      "name": "hashed"},
                     {"key": OTHER, "name": "limited",
                      "rate_limit": {"requests_per_minute": 60, "burst": 2},
                      "upstream_headers": {"Authorization": "Bearer backend-secret"}}]}})


@pytest.mark.parametrize("headers,why", [
    ({}, "missing API key"),
    (bearer("sk-wrong-key-000"), "invalid API key"),
    ({"Authorization": KEY}, "malformed"),
    ({"Authorization": "Basic " + KEY}, "malformed"),
])
async def test_missing_or_wrong_key_is_401(authed, standin, headers, why):
    status, body, resp_headers = await post(authed.url, headers)
    assert_openai_error(body, 401, status)
    assert why in body["error"]["message"] and body["error"]["type"] == "authentication_error"
    assert resp_headers["WWW-Authenticate"].startswith("Bearer")
    assert standin.requests == []


async def test_duplicated_authorization_header_is_401(authed, standin):
    async with aiohttp.ClientSession() as client:
        headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer sk-other-xx")]
        async with client.post(authed.url + "/v1/chat/completions", json=CHAT,
                               headers=headers) as r:
            assert_openai_error(await r.json(), 401, r.status)
    assert standin.requests == []


async def test_plain_and_hashed_keys_pass_and_are_not_forwarded(authed, standin):
    for key in (KEY, HASHED):
        status, body, _ = await post(authed.url, bearer(key))
        assert status == 200, body
    assert all("Authorization" not in r["headers"] for r in standin.requests)
    async with aiohttp.ClientSession() as client:
        async with client.get(authed.url + "/v1/models") as r:
            assert r.status == 401
        async with client.get(authed.url + "/v1/models", headers=bearer(KEY)) as r:
            assert r.status == 200
        async with client.get(authed.url + "/health") as r:       # probes need no key
            assert r.status == 200


async def test_forward_auth_passes_the_client_key(make_gateway, standin):
    gw = await make_gateway({"upstreams": [{"url": standin.url}],
                             "auth": {"api_keys": [KEY], "forward_auth": True}})
    assert (await post(gw.url, bearer(KEY)))[0] == 200
    assert standin.requests[-1]["headers"]["Authorization"] == f"Bearer {KEY}"


async def test_per_key_upstream_credentials(authed, standin):
    assert (await post(authed.url, bearer(OTHER)))[0] == 200
    assert standin.requests[-1]["headers"].getall("Authorization") == ["Bearer backend-secret"]


async def test_per_key_rate_limit(authed, standin):
    results = [await post(authed.url, bearer(OTHER)) for _ in range(3)]
    assert [s for s, _, _ in results] == [200, 200, 429]
    status, body, headers = results[2]
    assert_openai_error(body, 429, status)
    assert int(headers["Retry-After"]) >= 1
    assert (await post(authed.url, bearer(KEY)))[0] == 200     # other keys are not limited
    assert len(standin.requests) == 3


@pytest.mark.parametrize("auth,message", [
    ({"api_keys": ["short"]}, "auth.api_keys[0].key: too short"),
    ({"api_keys": ["sha256:abc"]}, "auth.api_keys[0].key: sha256: must be followed"),
    ({"api_keys": []}, "auth.api_keys: must list at least one key"),
    ({"api_keys": [{"key": KEY, "rate_limit": {"requests_per_minute": 0}}]},
     "auth.api_keys[0].rate_limit.requests_per_minute: must be > 0"),
    ({"keys": [KEY]}, "auth.keys: unknown key"),
])
def test_auth_config_errors_name_the_key(auth, message):
    with pytest.raises(ConfigError) as e:
        config_mod.validate({"upstreams": [{"url": "http://127.0.0.1:9"}], "auth": auth})
    assert message in str(e.value)


# --- request limits --------------------------------------------------------------------------
@pytest.fixture
async def limited(standin):
    """A gateway started like `prefixgate serve` does, with small request limits."""
    cfg = config_mod.validate({"upstreams": [{"url": standin.url}], "limits": {
        "max_header_bytes": 1024, "max_line_bytes": 1024, "max_headers": 20,
        "body_timeout_s": 0.5, "max_json_depth": 8}})
    gw = Gateway(cfg)
    runner, url = await start_app(gw.make_app(), "127.0.0.1", 0, **gw.server_kw())
    yield url
    await runner.cleanup()


@pytest.mark.parametrize("headers", [
    {"X-Big": "x" * 5000},
    {f"X-H{i}": "v" for i in range(40)},
])
async def test_oversized_headers_are_rejected(limited, standin, headers):
    async with aiohttp.ClientSession() as client:
        async with client.post(limited + "/v1/chat/completions", json=CHAT,
                               headers=headers) as r:
            assert r.headers["Content-Type"].startswith("application/json")
            assert_openai_error(await r.json(), 431, r.status)
    assert standin.requests == []


@pytest.mark.parametrize("head", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
])
async def test_unparsable_requests_get_json_errors(limited, standin, head):
    host, port = limited.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head)
    raw = await asyncio.wait_for(reader.read(), 5)     # answered, then closed
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    status = int(status_line.split()[1])
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert_openai_error(body, 431 if b"a" * 2000 in head else 400, status)
    assert standin.requests == []


async def test_deep_json_and_wrong_types_are_400(limited, standin):
    deep = {"messages": [{"role": "user", "content": "x"}]}
    node = deep
    for _ in range(20):
        node["x"] = {}
        node = node["x"]
    for body, why in [(deep, "nested deeper than 8"),
                      ({"messages": "hi"}, "'messages'"),
                      ({**CHAT, "stream": "yes"}, "'stream'"),
                      ({**CHAT, "max_tokens": "10"}, "'max_tokens'")]:
        status, payload, _ = await post(limited, json=body)
        assert_openai_error(payload, 400, status)
        assert why in payload["error"]["message"]
    status, payload, _ = await post(limited, data=b"[" * 100000 + b"]" * 100000)
    assert_openai_error(payload, 400, status)
    assert standin.requests == []


async def test_trickled_body_times_out_408(limited):
    host, port = limited.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
    assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head
    writer.close()


# --- no open proxy ---------------------------------------------------------------------------
async def test_nothing_in_a_request_picks_the_host(make_standin, make_gateway):
    real, evil = await make_standin(), await make_standin()
    # the real upstream serves a model named like the evil URL: a name routes, never a host
    gw = await make_gateway({"upstreams": [{"name": "real", "url": real.url,
                                            "models": [evil.url + "/v1"]}]})
    evil_host = evil.url.removeprefix("http://")
    sneaky = {**CHAT, "url": evil.url, "base_url": evil.url, "api_base": evil.url,
              "model": evil.url + "/v1", "upstream": "evil", "host": evil_host}
    async with aiohttp.ClientSession() as client:
        for headers in ({"Host": evil_host}, {"X-Forwarded-Host": evil_host},
                        {"x-prefixgate-upstream": evil.url}, {"Forwarded": f"host={evil_host}"}):
            async with client.post(gw.url + "/v1/chat/completions", json=sneaky,
                                   headers=headers) as r:
                assert r.status == 200 and r.headers["x-prefixgate-upstream"] == "real"
    # absolute-form request lines and odd paths, written raw
    host, port = gw.url.removeprefix("http://").split(":")
    body = json.dumps(CHAT).encode()
    for target in (f"{evil.url}/v1/chat/completions", f"//{evil_host}/v1/chat/completions",
                   f"/v1/chat/completions@{evil_host}", f"http://{evil_host}@{host}:{port}"
                   "/v1/chat/completions"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {target} HTTP/1.1\r\nHost: {evil_host}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close"
                     f"\r\n\r\n".encode() + body)
        await writer.drain()
        status_line = (await asyncio.wait_for(reader.read(), 5)).split(b"\r\n", 1)[0]
        writer.close()
        assert status_line.split()[1] in (b"200", b"400", b"404"), (target, status_line)
    assert evil.connections == 0 and evil.requests == []
    assert len(real.requests) >= 4


async def test_admin_listen_moves_metrics_off_the_public_address(standin):
    cfg = config_mod.validate({"upstreams": [{"url": standin.url}], "plugins": ["metrics"],
                               "admin_listen": {"host": "127.0.0.1", "port": 0}})
    gw = Gateway(cfg)
    runner, url = await start_app(gw.make_app())
    admin, admin_url = await start_app(gw.make_admin_app())
    try:
        async with aiohttp.ClientSession() as client:
            async with client.get(url + "/metrics") as r:
                assert r.status == 404
            async with client.get(admin_url + "/metrics") as r:
                assert r.status == 200 and "prefixgate_ttft_seconds" in await r.text()
            async with client.get(admin_url + "/health") as r:
                assert r.status == 200 and "upstreams" in await r.json()
            async with client.get(url + "/health") as r:         # public: up or down only
                assert r.status == 200 and await r.json() == {"status": "ok"}
    finally:
        await admin.cleanup()
        await runner.cleanup()

