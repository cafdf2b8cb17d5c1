"""Responses API ids that name their upstream: two gateway replicas sharing `id_secret`, in
front of two stand-ins that keep responses in memory (as vLLM does), follow each other's
responses; the upstream only sees its own ids; a forged id, one issued under another secret
and one whose upstream left are clear 404s; ids split across reads are still swapped."""
from __future__ import annotations

import json

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.response_ids import ResponseIds, Rewriter

SECRET = "a-secret-shared-by-the-replicas"


def config(*standins, secret: str = SECRET) -> dict:
    return {"upstreams": [{"name": n, "url": s.url} for n, s in zip("ab", standins)],
            "responses": {"id_secret": secret}}


async def call(client, method, url, body=None) -> tuple[int, dict, str | None]:
    async with client.request(method, url, json=body) as r:
        return r.status, await r.json(), r.headers.get("x-prefixgate-upstream")


async def streamed(client, url, body) -> tuple[int, list, str | None]:
    async with client.post(url, json={**body, "stream": True}) as r:
        raw = (await r.read()).decode()
    events = [json.loads(line[6:]) for e in raw.split("\n\n") for line in e.splitlines()
              if line.startswith("data: {")]
    return r.status, events, r.headers.get("x-prefixgate-upstream")


def own_ids(standin) -> set[str]:
    return set(standin.responses)


async def test_any_replica_follows_a_response_to_its_upstream(make_standin, make_gateway):
    a, b = await make_standin(models=["m"]), await make_standin(models=["m"])
    replicas = [await make_gateway(config(a, b)) for _ in range(2)]
    async with aiohttp.ClientSession() as client:
        status, first, home = await call(client, "POST", replicas[0].url + "/v1/responses",
                                         {"model": "m", "input": "start"})
        assert status == 200
        last, seen = first["id"], [first["id"]]
        for turn in range(6):               # follow-ups alternate replicas, whole and streamed
            gw = replicas[(turn + 1) % 2]
            body = {"model": "m", "input": f"turn {turn}", "previous_response_id": last}
            if turn % 2:
                status, events, up = await streamed(client, gw.url + "/v1/responses", body)
                answer = events[-1]["response"]
                assert {e["response"]["id"] for e in events if "response" in e} == {answer["id"]}
            else:
                status, answer, up = await call(client, "POST", gw.url + "/v1/responses", body)
            assert status == 200 and up == home, (turn, answer)
            assert answer["previous_response_id"] == last
            last = answer["id"]
            seen.append(last)
        for i, rid in enumerate(seen):      # reads on either replica
            status, got, up = await call(client, "GET",
                                         replicas[i % 2].url + f"/v1/responses/{rid}")
            assert status == 200 and up == home and got["id"] == rid
        _, queued, owner = await call(client, "POST", replicas[0].url + "/v1/responses",
                                      {"model": "m", "input": "x", "background": True,
                                       "x_standin": {"first_delay": 5}})
        status, cancelled, up = await call(
            client, "POST", replicas[1].url + f"/v1/responses/{queued['id']}/cancel")
        assert status == 200 and up == owner and cancelled["id"] == queued["id"]
    holder = a if home == "a" else b
    # the client saw only wrapped ids; the upstream only its own
    assert all(rid.startswith("resp_pg") for rid in seen)
    assert {rid.split("_", 2)[2] for rid in seen} <= own_ids(holder)
    sent = [r["json"].get("previous_response_id") for r in holder.requests
            if r["json"] and r["json"].get("previous_response_id")]
    assert sent and all(not p.startswith("resp_pg") for p in sent)


async def test_forged_foreign_and_orphaned_ids_are_404(make_standin, make_gateway):
    a, b = await make_standin(models=["m"]), await make_standin(models=["m"])
    gw = await make_gateway(config(a, b))
    other_fleet = await make_gateway(config(a, b, secret="another-fleets-secret-key"))
    async with aiohttp.ClientSession() as client:
        _, made, home = await call(client, "POST", gw.url + "/v1/responses",
                                   {"model": "m", "input": "x"})
        rid = made["id"]
        mac = rid[15:31]                     # resp_pg, 8 hex of tag, 16 hex of MAC, _, the id
        forged = rid[:15] + ("0" * 16 if mac != "0" * 16 else "1" * 16) + rid[31:]
        for bad, where in ((forged, gw), (rid, other_fleet), ("resp_pgnothex", gw)):
            for method, path, body in (
                    ("GET", f"/v1/responses/{bad}", None),
                    ("POST", f"/v1/responses/{bad}/cancel", None),
                    ("POST", "/v1/responses", {"model": "m", "input": "y",
                                               "previous_response_id": bad})):
                status, payload, _ = await call(client, method, where.url + path, body)
                assert status == 404, (bad, method, path, payload)
                assert payload["error"]["code"] == "response_not_found"
                assert "not issued by this gateway fleet" in payload["error"]["message"]
        # its upstream leaves the fleet: the id names nobody here
        await gw.gateway.set_upstreams([u.cfg for u in gw.gateway.upstreams if u.name != home])
        status, payload, _ = await call(client, "GET", gw.url + f"/v1/responses/{rid}")
    assert status == 404 and "no longer in this gateway's fleet" in payload["error"]["message"]
    assert len(a.requests) + len(b.requests) == 1          # nothing forged reached a server


def test_ids_split_across_reads_are_still_swapped():
    ids = ResponseIds({"id_secret": SECRET})
    events = (b'data: {"type":"response.created","response":{"id":"resp_up1",'
              b'"previous_response_id":"resp_up0"}}\n\n'
              b'data: {"type":"response.completed","response":{"id":"resp_up1"}}\n\n'
              b"data: [DONE]\n\n")
    previous = (ids.wrap("a", "resp_up0"), "resp_up0")
    rewriter = Rewriter(ids, "a", previous)
    out = b"".join(rewriter.feed(events[i:i + 1]) for i in range(len(events))) + rewriter.flush()
    expected = (events.replace(b'"resp_up1"', json.dumps(ids.wrap("a", "resp_up1")).encode())
                .replace(b'"resp_up0"', json.dumps(previous[0]).encode()))
    assert out == expected and b"resp_up1\"" not in out.replace(b"_resp_up1\"", b"")


@pytest.mark.parametrize("responses, error", [
    ({"id_secret": "short"}, "responses.id_secret: must be at least 16 characters"),
    ({"secret": SECRET}, "responses.secret: unknown key"),
])
def test_bad_response_settings_fail_at_start_naming_the_key(responses, error):
    with pytest.raises(ConfigError) as e:
        validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                  "responses": responses})
    assert str(e.value).startswith(error), str(e.value)
