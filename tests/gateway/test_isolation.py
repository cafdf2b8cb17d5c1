"""`isolation:` (proxy/isolation.py): each tenant's prefix cache its own through vLLM's
`cache_salt`. Real gateways on loopback in front of stand-ins that record what they received
and model a salted prefix cache as vLLM's; clients: the openai and anthropic SDKs, aiohttp."""
from __future__ import annotations

import anthropic
import openai
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.config import gateway as config
from tests.gateway.test_config import run_cli

KEYS = {"solo": "sk-solo-0000000001", "other": "sk-other-000000002",
        "acme-a": "sk-acme-a-00000003", "acme-b": "sk-acme-b-00000004"}
MODEL = "standin-model"
DOC = "The merger closes on the 3rd of March at a price of 41 dollars a share. " * 12


def auth(cache_group_of_acme: bool = True) -> dict:
    return {"api_keys": [{"key": k, "name": n, **({"cache_group": "acme"} if
                                                   n.startswith("acme") and cache_group_of_acme
                                                   else {})} for n, k in KEYS.items()]}


def gw_config(*standins, **isolation) -> dict:
    cfg = {"upstreams": [{"name": f"u{i}", "url": s.url} for i, s in enumerate(standins)],
           "auth": auth()}
    if isolation:
        cfg["isolation"] = isolation
    return cfg


def salts(standin, path: str | None = None) -> list:
    """The cache_salt of each request the stand-in received (None: none), in order."""
    return [(r["json"] or {}).get("cache_salt", None) for r in standin.requests
            if path is None or r["path"] == path]


async def chat(gw, key: str, content: str = DOC, **extra):
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    return await client.chat.completions.create(
        model=MODEL, max_tokens=1, extra_body=extra,
        messages=[{"role": "user", "content": content}])


async def every_endpoint(gw, key: str) -> None:
    """A prompt on each endpoint vLLM caches one for, with each API's own client."""
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    await oa.chat.completions.create(model=MODEL, max_tokens=1,
                                     messages=[{"role": "user", "content": DOC}])
    await oa.completions.create(model=MODEL, max_tokens=1, prompt=DOC)
    await an.messages.create(model=MODEL, max_tokens=1, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": DOC}])
    await oa.responses.create(model=MODEL, input=DOC, max_output_tokens=16)
    await oa.embeddings.create(model=MODEL, input=DOC)
    await an.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": DOC}])


SALTED = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
          "/v1/embeddings")


async def test_each_tenant_its_salt_on_every_endpoint_the_same_on_two_replicas(make_standin,
                                                                              make_gateway):
    standin = await make_standin(tokens=1)
    replicas = [await make_gateway(gw_config(standin)) for _ in range(2)]   # per_key: default
    seen: dict[tuple[int, str], list] = {}
    for r, gw in enumerate(replicas):
        for name, key in KEYS.items():
            standin.requests.clear()
            await every_endpoint(gw, key)
            assert [r["path"] for r in standin.requests] == [*SALTED,
                                                             "/v1/messages/count_tokens"]
            seen[r, name] = salts(standin)
    for r in range(2):
        for name, key in KEYS.items():
            got = seen[r, name]
            assert got[-1] is None                     # count_tokens caches nothing
            assert len(set(got[:-1])) == 1, got        # one salt on every prompt it sends
            salt = got[0]
            assert len(salt) == 43 and key not in salt and not set(salt) & set("@/\\\0")
            assert seen[1 - r, name] == got            # every replica, the same salt
    tenant = {name: seen[0, name][0] for name in KEYS}
    assert tenant["acme-a"] == tenant["acme-b"]        # one cache_group: one tenant
    assert len({tenant["solo"], tenant["other"], tenant["acme-a"]}) == 3


async def test_another_secret_other_salts(make_standin, make_gateway):
    standin = await make_standin(tokens=1)
    derived = await make_gateway(gw_config(standin))
    given = await make_gateway(gw_config(standin, secret="s" * 16))
    again = await make_gateway(gw_config(standin, secret="s" * 16))
    for gw in (derived, given, again):
        await chat(gw, KEYS["solo"])
    a, b, c = salts(standin)
    assert a != b and b == c


@pytest.mark.parametrize("client_salt", [False, True])
async def test_a_clients_own_salt_is_replaced_unless_allowed_and_then_stays_its_tenants(
        make_standin, make_gateway, client_salt):
    standin = await make_standin(tokens=1)
    gw = await make_gateway(gw_config(standin, client_salt=client_salt))
    await chat(gw, KEYS["solo"])
    for name in ("solo", "other"):
        for asked in ("user-1", "user-2"):
            await chat(gw, KEYS[name], cache_salt=asked)
    tenant, solo_1, solo_2, other_1, other_2 = salts(standin)
    if not client_salt:
        assert solo_1 == solo_2 == tenant              # replaced: the tenant's own
        assert other_1 == other_2 != tenant
        return
    # folded under the tenant: one cache per (tenant, client salt), never the client's value,
    # so no client salt reaches another tenant's cache
    assert len({tenant, solo_1, solo_2, other_1, other_2}) == 5
    assert not {solo_1, solo_2, other_1, other_2} & {"user-1", "user-2"}
    await chat(gw, KEYS["solo"], cache_salt="user-1")
    assert salts(standin)[-1] == solo_1


async def test_shared_or_keyless_sets_nothing_and_passes_the_clients_salt(make_standin,
                                                                         make_gateway):
    standin = await make_standin(tokens=1)
    shared = await make_gateway(gw_config(standin, cache="shared"))
    keyless = await make_gateway({"upstreams": [{"name": "u0", "url": standin.url}]})
    assert keyless.gateway.config["isolation"]["cache"] == "shared"
    for gw in (shared, keyless):
        await chat(gw, KEYS["solo"])
        await chat(gw, KEYS["solo"], cache_salt="their-own")
    assert salts(standin) == [None, "their-own", None, "their-own"]


async def test_an_upstream_that_takes_no_cache_salt_is_never_sent_one(make_standin,
                                                                      make_gateway):
    strict = await make_standin(tokens=1, refused_fields=["cache_salt"])
    unaware = await make_gateway(gw_config(strict))
    with pytest.raises(openai.BadRequestError, match="cache_salt"):    # the stand-in refuses
        await chat(unaware, KEYS["solo"])
    told = await make_gateway(gw_config(strict, unsalted_upstreams=["u0"]))
    strict.requests.clear()
    await every_endpoint(told, KEYS["solo"])
    await chat(told, KEYS["solo"], cache_salt="asked")
    assert len(strict.requests) == 7 and salts(strict) == [None] * 7


async def test_a_retry_elsewhere_carries_the_salt_as_that_upstream_takes_it(make_standin,
                                                                           make_gateway):
    """The salt is fitted to each attempt's upstream: a failed unsalted one, then a salted."""
    down = await make_standin(tokens=1, fail="status", status=503,
                              refused_fields=["cache_salt"])
    up = await make_standin(tokens=1)
    gw = await make_gateway({**gw_config(down, up, unsalted_upstreams=["u0"]),
                             "plugins": [{"prefix_route": {"policy": "chwbl"}}]})
    for i in range(12):     # some go to u0 first (refused there), then to u1
        await chat(gw, KEYS["solo"], f"{i} {DOC}")
    assert down.requests and salts(down) == [None] * len(down.requests)
    assert len(set(salts(up))) == 1 and None not in salts(up) and len(up.requests) == 12


async def test_per_key_hides_another_tenants_document_shared_shows_it(make_standin,
                                                                      make_gateway):
    """The side channel itself: tenant `other` probes whether `solo` sent DOC. The stand-in's
    prefix cache is vLLM's in miniature (a salt folded into the first block): a probe is
    served from cache under `shared` and is not under `per_key`."""
    for mode, leaks in (("shared", True), ("per_key", False)):
        standin = await make_standin(tokens=1, prefix_cache=True)
        gw = await make_gateway(gw_config(standin, cache=mode))
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["other"],
                                    max_retries=0)
        await chat(gw, KEYS["solo"])                  # the victim's document
        probe = await client.chat.completions.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": DOC}])
        cached = probe.usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) is leaks, (mode, cached)
        again = await chat(gw, KEYS["solo"])          # its own tenant still hits its cache
        assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("isolation, extra, message", [
    ({"cache": "per_tenant"}, {}, "isolation.cache: must be one of per_key, shared"),
    ({"cache": "per_key"}, {"auth": None}, "isolation.cache: per_key needs auth.api_keys"),
    ({"secret": "short"}, {}, "isolation.secret: must be at least 16 characters"),
    ({"unsalted_upstreams": ["nope"]}, {}, "isolation.unsalted_upstreams[0]: no upstream"),
    ({"client_salts": True}, {}, "isolation.client_salts: unknown key"),
    ({}, {"auth": {"api_keys": [{"key": KEYS["solo"], "cache_group": ""}]}},
     "auth.api_keys[0].cache_group: must be a non-empty name"),
])
def test_a_bad_isolation_config_names_its_key(isolation, extra, message):
    raw = {"upstreams": [{"name": "u0", "url": "http://127.0.0.1:9"}], "auth": auth(),
           "isolation": isolation, **extra}
    if raw["auth"] is None:
        del raw["auth"]
    with pytest.raises(ConfigError) as e:
        config.validate(raw)
    assert message in str(e.value)


def test_serve_with_a_bad_isolation_config_exits_naming_the_key(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("upstreams:\n  - {name: a, url: 'http://127.0.0.1:9'}\n"
                    "isolation: {cache: per_key}\n")
    proc = run_cli("serve", "--config", str(path))
    assert proc.returncode == 2
    assert proc.stderr.startswith("prefixgate: config error: isolation.cache: per_key needs")
