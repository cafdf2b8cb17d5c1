"""The OpenAI-compatible surface through the real gateway, against vLLM-shaped stand-ins:
routing by `model` (LoRA adapters included), every endpoint whole and streamed, uploads byte
for byte, Responses API stickiness, model errors, aliases, models learned at run time,
passthrough, and the openai SDK."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import Counter

import aiohttp
import openai
import pytest

from tests.helpers import assert_openai_error, event_json, read_events

UP = "x-prefixgate-upstream"
MB2 = os.urandom(2 * 1024 * 1024)
SHA_MB2 = hashlib.sha256(MB2).hexdigest()


# --- helpers ---------------------------------------------------------------------------------
def fleet(*named, **top) -> dict:
    """A gateway config: upstreams from (name, stand-in) pairs, plus top-level keys."""
    return {"upstreams": [{"name": n, "url": s.url} for n, s in named], **top}


async def call(client, method, url, body=None, **kw) -> tuple[int, dict | str, str | None]:
    async with client.request(method, url, json=body, **kw) as r:
        text = await r.text()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = text
        return r.status, payload, r.headers.get(UP)


async def stream(client, url, body, **kw) -> tuple[int, list, str | None, list[float]]:
    """(status, parsed SSE events, upstream, arrival times) of a streamed POST."""
    async with client.post(url, json=body, **kw) as r:
        assert r.headers.get("Content-Type", "").startswith("text/event-stream"), r.headers
        timed = await read_events(r)
        return r.status, [_event(e) for _, e in timed], r.headers.get(UP), [t for t, _ in timed]


def _event(raw: bytes):
    """An SSE event: its JSON data (Responses API events keep their `event:` line's name)."""
    lines = raw.decode().split("\n")
    name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
    data = next(ln for ln in lines if ln.startswith("data: "))
    parsed = event_json(data.encode())
    if name is not None:
        assert parsed["type"] == name
    return parsed


def seen(standin, path=None) -> list:
    """The models named in the JSON requests a stand-in received (on `path`)."""
    return [r["json"].get("model") for r in standin.requests
            if r["json"] is not None and (path is None or r["path"] == path)]


class _Sink:
    def __init__(self):
        self.data = bytearray()

    async def write(self, chunk):
        self.data += chunk


async def form(*fields) -> tuple[aiohttp.MultipartWriter, bytes]:
    """An aiohttp FormData of (name, value[, filename, content type]) in this order, as the
    payload to send and the exact bytes it sends."""
    fd = aiohttp.FormData()
    for name, value, *file in fields:
        if file:
            fd.add_field(name, value, filename=file[0], content_type=file[1])
        else:
            fd.add_field(name, value)
    payload = fd()
    sink = _Sink()
    await payload.write(sink)
    return payload, bytes(sink.data)


def upload_record(standin) -> dict:
    (entry,) = [r for r in standin.requests if r["path"].startswith("/v1/audio/")]
    return entry


# --- routing by model ------------------------------------------------------------------------
async def test_each_model_reaches_only_the_upstreams_serving_it(make_standin, make_gateway):
    a = await make_standin(models=["llama"], lora={"llama-sql": "llama"})
    b = await make_standin(models=["qwen"])
    c = await make_standin(models=["llama"])
    gw = await make_gateway(fleet(("a", a), ("b", b), ("c", c)))
    where: dict[str, Counter] = {}
    async with aiohttp.ClientSession() as client:
        for model in ("llama", "llama-sql", "qwen"):
            for i in range(10):
                path, body = [("/v1/chat/completions",
                               {"model": model, "messages": [{"role": "user", "content": "hi"}]}),
                              ("/v1/embeddings", {"model": model, "input": f"text {i}"})][i % 2]
                status, payload, up = await call(client, "POST", gw.url + path, body)
                assert status == 200, payload
                assert payload["model"] == model       # vLLM names the adapter it ran
                where.setdefault(model, Counter())[up] += 1
        status, listed, _ = await call(client, "GET", gw.url + "/v1/models")
    assert set(where["llama-sql"]) == {"a"} and set(where["qwen"]) == {"b"}
    assert set(where["llama"]) <= {"a", "c"}
    assert set(seen(a)) <= {"llama", "llama-sql"} and set(seen(b)) == {"qwen"}
    assert set(seen(c)) <= {"llama"}
    assert len(seen(a)) + len(seen(b)) + len(seen(c)) == 30
    cards = {m["id"]: m for m in listed["data"]}
    assert status == 200 and set(cards) == {"llama", "llama-sql", "qwen"}
    assert cards["llama-sql"]["parent"] == "llama" and cards["llama"]["parent"] is None
    assert cards["llama"]["root"] == "llama" and cards["llama-sql"]["object"] == "model"


async def test_standin_answers_like_vllm_for_a_model_it_does_not_serve(make_standin):
    a = await make_standin(models=["llama"], lora={"llama-sql": "llama"})
    async with aiohttp.ClientSession() as client:
        for path, body in [("/v1/chat/completions", {"model": "gpt-4", "messages": []}),
                           ("/v1/embeddings", {"model": "gpt-4", "input": "x"}),
                           ("/v1/responses", {"model": "gpt-4", "input": "x"})]:
            status, payload, _ = await call(client, "POST", a.url + path, body)
            assert status == 404 and payload == {"error": {
                "message": "The model `gpt-4` does not exist. Valid aliases: llama.",
                "type": "NotFoundError", "param": "model", "code": 404}}
        status, listed, _ = await call(client, "GET", a.url + "/v1/models")
    assert [m["id"] for m in listed["data"]] == ["llama", "llama-sql"]
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len",
            "permission"} <= set(listed["data"][1])


# --- every endpoint, whole and streamed ----------------------------------------------------
JSON_CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     lambda p: p["object"] == "chat.completion" and p["choices"][0]["message"]["content"]),
    ("/v1/completions", {"prompt": "say"},
     lambda p: p["object"] == "text_completion" and p["choices"][0]["text"]),
    ("/v1/embeddings", {"input": ["a", "b"]},
     lambda p: p["object"] == "list" and p["id"].startswith("embd-") and len(p["data"]) == 2
     and len(p["data"][1]["embedding"]) == 8 and p["usage"]["completion_tokens"] == 0),
    ("/v1/responses", {"input": "hello"},
     lambda p: p["object"] == "response" and p["status"] == "completed"
     and p["id"].startswith("resp_") and p["output"][0]["content"][0]["text"].startswith("tok0")
     and p["usage"]["output_tokens"] == 6),
    ("/v1/rerank", {"query": "red fox", "documents": ["a red fox", "blue sky", "fox"]},
     lambda p: [r["index"] for r in p["results"]][0] == 0 and len(p["results"]) == 3
     and p["results"][0]["document"] == {"text": "a red fox"} and "total_tokens" in p["usage"]),
    ("/rerank", {"query": "q", "documents": ["q", "x"], "top_n": 1},
     lambda p: len(p["results"]) == 1 and p["id"].startswith("rerank-")),
    ("/v1/score", {"text_1": "q", "text_2": ["q", "x"]},
     lambda p: p["object"] == "list" and [d["object"] for d in p["data"]] == ["score"] * 2),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "c"]},
     lambda p: len(p["data"]) == 2 and p["data"][0]["score"] > p["data"][1]["score"]),
    ("/tokenize", {"prompt": "héllo"},
     lambda p: p["count"] == 6 and p["tokens"] == list("héllo".encode())
     and p["max_model_len"] == 4096),
    ("/detokenize", {"tokens": list("héllo".encode())}, lambda p: p == {"prompt": "héllo"}),
    ("/v1/moderations", {"input": ["a plan to attack", "a nice day"]},
     lambda p: p["id"].startswith("modr-") and [r["flagged"] for r in p["results"]]
     == [True, False] and p["results"][0]["categories"]["violence"] is True),
]


@pytest.fixture
async def one(make_standin, make_gateway):
    """A stand-in serving model `m` (6 tokens, 30 ms apart) behind a gateway."""
    s = await make_standin(models=["m"], tokens=6, gap=0.03)
    gw = await make_gateway(fleet(("a", s)))
    return s, gw


@pytest.mark.parametrize("path,body,check", JSON_CASES, ids=[c[0] for c in JSON_CASES])
async def test_endpoint_whole(one, path, body, check):
    s, gw = one
    async with aiohttp.ClientSession() as client:
        status, payload, up = await call(client, "POST", gw.url + path, {"model": "m", **body})
    assert status == 200 and up == "a", payload
    assert check(payload), payload
    assert s.requests[-1]["path"] == path and s.requests[-1]["json"]["model"] == "m"


@pytest.mark.parametrize("path,body,text", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     lambda e: (e["choices"][0]["delta"].get("content") or "") if e["choices"] else ""),
    ("/v1/completions", {"prompt": "say"}, lambda e: e["choices"][0]["text"]),
])
async def test_completions_stream(one, path, body, text):
    _, gw = one
    async with aiohttp.ClientSession() as client:
        status, events, up, times = await stream(client, gw.url + path,
                                                 {"model": "m", "stream": True, **body})
    assert status == 200 and up == "a" and events[-1] == "[DONE]"
    assert "".join(text(e) for e in events[:-1]) == "".join(f"tok{i} " for i in range(6))
    assert times[-1] - times[0] > 0.1              # relayed as it came, not at the end


async def test_responses_stream_events_in_order(one):
    s, gw = one
    async with aiohttp.ClientSession() as client:
        status, events, up, times = await stream(client, gw.url + "/v1/responses",
                                                 {"model": "m", "input": "hi", "stream": True})
        rid = events[0]["response"]["id"]
        got, stored, _ = await call(client, "GET", gw.url + f"/v1/responses/{rid}")
    assert status == 200 and up == "a"
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed" and types.count("response.output_text.delta") == 6
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert final["id"] == rid and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == deltas == "tok0 tok1 tok2 tok3 tok4 tok5 "
    assert times[-1] - times[0] > 0.1
    assert got == 200 and stored == final          # kept in the stand-in's response store


async def test_responses_retrieve_cancel_and_unknown_ids(one):
    s, gw = one
    async with aiohttp.ClientSession() as client:
        _, done, _ = await call(client, "POST", gw.url + "/v1/responses",
                                {"model": "m", "input": "x"})
        status, payload, _ = await call(client, "POST",
                                        gw.url + f"/v1/responses/{done['id']}/cancel")
        assert status == 400 and payload["error"]["message"] == (
            "Cannot cancel a synchronous response.")
        _, queued, _ = await call(client, "POST", gw.url + "/v1/responses",
                                  {"model": "m", "input": "x", "background": True,
                                   "x_standin": {"first_delay": 5}})
        assert queued["status"] == "queued"
        status, cancelled, up = await call(client, "POST",
                                           gw.url + f"/v1/responses/{queued['id']}/cancel")
        assert status == 200 and cancelled["status"] == "cancelled" and up == "a"
        status, payload, _ = await call(client, "GET", gw.url + "/v1/responses/resp_nope")
        assert status == 404 and payload == {"error": {
            "message": "Response with id 'resp_nope' not found.",
            "type": "invalid_request_error", "param": "response_id", "code": 404}}
        status, payload, _ = await call(client, "POST", gw.url + "/v1/responses",
                                        {"model": "m", "input": "x",
                                         "previous_response_id": "resp_gone"})
        assert status == 404 and payload["error"]["param"] == "response_id"
        # a response id cannot smuggle a path of its own upstream
        status, _, _ = await call(client, "GET", gw.url + "/v1/responses/resp_x%2F..%2Fmodels")
        assert status == 404
    # it reached the stand-in's retrieve route as one id (aiohttp decodes request.path)
    assert s.requests[-1]["path"] == "/v1/responses/resp_x/../models"


async def test_audio_whole_and_streamed(one):
    s, gw = one
    async with aiohttp.ClientSession() as client:
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            payload, raw = await form(("model", "m"), ("file", b"RIFF" * 1000, "a.wav",
                                                       "audio/wav"))
            status, answer, up = await call(client, "POST", gw.url + path, data=payload)
            assert status == 200 and up == "a", answer
            assert answer["text"].startswith("heard 4000 bytes")
            assert ("usage" in answer) == path.endswith("transcriptions")
            assert s.requests[-1]["body_sha256"] == hashlib.sha256(raw).hexdigest()
        payload, _ = await form(("model", "m"), ("response_format", "text"),
                                ("file", b"x" * 10, "a.wav", "audio/wav"))
        status, answer, _ = await call(client, "POST", gw.url + "/v1/audio/transcriptions",
                                       data=payload)
        assert status == 200 and answer.startswith("heard 10 bytes")


async def test_audio_stream(one):
    _, gw = one
    payload, _ = await form(("model", "m"), ("stream", "true"),
                            ("file", b"x" * 100, "a.wav", "audio/wav"))
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/audio/transcriptions", data=payload) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            timed = await read_events(r)
    events = [event_json(e) for _, e in timed]
    assert events[-1] == "[DONE]" and events[0]["object"] == "transcription.chunk"
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == (
        "tok0 tok1 tok2 tok3 tok4 tok5 ")
    assert timed[-1][0] - timed[0][0] > 0.1       # relayed as it comes, not buffered


# --- uploads byte for byte -------------------------------------------------------------------
async def test_upload_with_model_first_is_routed_and_byte_identical(make_standin, make_gateway):
    whisper = await make_standin(models=["whisper"])
    other = await make_standin(models=["llama"])
    gw = await make_gateway(fleet(("w", whisper), ("o", other)))
    payload, raw = await form(("model", "whisper"), ("language", "en"),
                              ("file", MB2, "speech.wav", "audio/wav"))
    async with aiohttp.ClientSession() as client:
        status, answer, up = await call(client, "POST", gw.url + "/v1/audio/transcriptions",
                                        data=payload)
    assert status == 200 and up == "w", answer
    entry = upload_record(whisper)
    assert entry["file"] == {"field": "file", "filename": "speech.wav",
                             "content_type": "audio/wav", "size": len(MB2), "sha256": SHA_MB2}
    assert entry["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert entry["body_size"] == len(raw) and entry["parts"] == ["model", "language", "file"]
    assert entry["form"] == {"model": "whisper", "language": "en"}
    assert other.requests == []


async def test_a_chunked_upload_is_byte_identical(make_standin, make_gateway):
    whisper, other = await make_standin(models=["whisper"]), await make_standin(models=["llama"])
    gw = await make_gateway(fleet(("w", whisper), ("o", other)))
    payload, raw = await form(("model", "whisper"), ("file", MB2, "speech.wav", "audio/wav"))

    async def pieces():                 # no length known: sent chunk-encoded
        for i in range(0, len(raw), 100_000):
            yield raw[i:i + 100_000]
    async with aiohttp.ClientSession() as client:
        status, answer, up = await call(client, "POST", gw.url + "/v1/audio/transcriptions",
                                        data=pieces(),
                                        headers={"Content-Type": payload.content_type})
    assert status == 200 and up == "w", answer
    entry = upload_record(whisper)
    assert entry["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert entry["file"]["sha256"] == SHA_MB2


async def test_an_upload_over_max_body_bytes_is_413(make_standin, make_gateway):
    s = await make_standin(models=["whisper"])
    gw = await make_gateway({**fleet(("a", s)), "limits": {"max_body_bytes": 1024 * 1024}})
    payload, _ = await form(("model", "whisper"), ("file", MB2, "speech.wav", "audio/wav"))
    async with aiohttp.ClientSession() as client:
        status, answer, _ = await call(client, "POST", gw.url + "/v1/audio/transcriptions",
                                       data=payload)
    assert status == 413, answer


async def test_upload_with_file_first(make_standin, make_gateway):
    s = await make_standin(models=["whisper"])
    gw = await make_gateway(fleet(("a", s)))
    payload, raw = await form(("file", MB2, "speech.wav", "audio/wav"), ("model", "whisper"))
    async with aiohttp.ClientSession() as client:
        status, answer, up = await call(client, "POST", gw.url + "/v1/audio/translations",
                                        data=payload)
    assert status == 200 and up == "a", answer
    entry = upload_record(s)
    assert entry["file"]["sha256"] == SHA_MB2 and entry["file"]["size"] == len(MB2)
    assert entry["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert entry["parts"] == ["file", "model"]


async def test_upload_with_file_first_on_a_two_model_fleet_needs_the_model_first(
        make_standin, make_gateway):
    a, b = await make_standin(models=["whisper"]), await make_standin(models=["llama"])
    gw = await make_gateway(fleet(("a", a), ("b", b)))
    payload, _ = await form(("file", b"x" * 1000, "a.wav", "audio/wav"), ("model", "whisper"))
    async with aiohttp.ClientSession() as client:
        status, answer, _ = await call(client, "POST", gw.url + "/v1/audio/transcriptions",
                                       data=payload)
    assert_openai_error(answer, 400, status)
    assert "'model'" in answer["error"]["message"]
    assert a.requests == b.requests == []


# --- Responses API stickiness ----------------------------------------------------------------
async def test_previous_response_id_goes_back_to_its_upstream(make_standin, make_gateway):
    a, b = await make_standin(models=["m"]), await make_standin(models=["m"])
    gw = await make_gateway(fleet(("a", a), ("b", b)))
    async with aiohttp.ClientSession() as client:
        status, first, home = await call(client, "POST", gw.url + "/v1/responses",
                                         {"model": "m", "input": "start"})
        assert status == 200
        last, ids = first["id"], [first["id"]]
        for i in range(10):
            body = {"model": "m", "input": f"turn {i}", "previous_response_id": last}
            if i % 2:
                status, events, up, _ = await stream(client, gw.url + "/v1/responses",
                                                     {**body, "stream": True})
                answer = events[-1]["response"]
            else:
                status, answer, up = await call(client, "POST", gw.url + "/v1/responses", body)
            assert status == 200 and up == home, (i, answer)
            assert answer["previous_response_id"] == last      # it continued that one
            last = answer["id"]
            ids.append(last)
        for rid in ids:
            status, got, up = await call(client, "GET", gw.url + f"/v1/responses/{rid}")
            assert status == 200 and up == home and got["id"] == rid
        for _ in range(3):               # background ones are cancelled where they run
            _, queued, owner = await call(client, "POST", gw.url + "/v1/responses",
                                          {"model": "m", "input": "x", "background": True,
                                           "x_standin": {"first_delay": 5}})
            status, cancelled, up = await call(
                client, "POST", gw.url + f"/v1/responses/{queued['id']}/cancel")
            assert status == 200 and up == owner and cancelled["status"] == "cancelled"
    away = b if home == "a" else a
    assert not [r for r in away.requests if (r["json"] or {}).get("previous_response_id")
                or r["path"].rsplit("/", 1)[-1] in ids]


# --- model errors ---------------------------------------------------------------------------
async def test_unknown_model_is_404_with_the_available_list(make_standin, make_gateway):
    a, b = await make_standin(models=["llama"]), await make_standin(models=["qwen"])
    gw = await make_gateway(fleet(("a", a), ("b", b)))
    async with aiohttp.ClientSession() as client:
        for path, body in [("/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "hi"}]}),
                           ("/v1/embeddings", {"input": "x"}), ("/v1/responses", {"input": "x"})]:
            status, payload, _ = await call(client, "POST", gw.url + path,
                                            {"model": "gpt-4", **body})
            assert_openai_error(payload, 404, status)
            assert payload["error"]["code"] == "model_not_found"
            assert "'gpt-4'" in payload["error"]["message"]
            assert "llama, qwen" in payload["error"]["message"]
        upload, _ = await form(("model", "gpt-4"), ("file", b"x", "a.wav", "audio/wav"))
        status, payload, _ = await call(client, "POST", gw.url + "/v1/audio/transcriptions",
                                        data=upload)
        assert status == 404 and payload["error"]["code"] == "model_not_found"
    assert a.requests == b.requests == []


async def test_a_body_without_model(make_standin, make_gateway):
    a, b = await make_standin(models=["llama"]), await make_standin(models=["qwen"])
    two = await make_gateway(fleet(("a", a), ("b", b)))
    single = await make_standin(models=["llama"])
    one = await make_gateway(fleet(("s", single)))
    async with aiohttp.ClientSession() as client:
        status, payload, _ = await call(client, "POST", two.url + "/v1/embeddings",
                                        {"input": "x"})
        assert_openai_error(payload, 400, status)
        assert "'model'" in payload["error"]["message"]
        assert a.requests == b.requests == []
        status, payload, up = await call(client, "POST", one.url + "/v1/embeddings",
                                         {"input": "x"})
        assert status == 200 and up == "s" and payload["model"] == "llama"
    assert single.requests[-1]["json"] == {"input": "x"}       # passed on as it was


async def test_model_aliases_rewrite_and_list(make_standin, make_gateway):
    s = await make_standin(models=["llama-3.1-8b"])
    gw = await make_gateway({**fleet(("a", s)), "model_aliases": {"gpt-4o": "llama-3.1-8b"}})
    async with aiohttp.ClientSession() as client:
        for path, body in [("/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "hi"}]}),
                           ("/v1/embeddings", {"input": "x"}),
                           ("/v1/responses", {"input": "x"})]:
            status, payload, _ = await call(client, "POST", gw.url + path,
                                            {"model": "gpt-4o", **body})
            assert status == 200, payload
        status, listed, _ = await call(client, "GET", gw.url + "/v1/models")
    assert seen(s) == ["llama-3.1-8b"] * 3              # the backend hears its own name
    cards = {m["id"]: m for m in listed["data"]}
    assert set(cards) == {"gpt-4o", "llama-3.1-8b"} and cards["gpt-4o"]["root"] == "llama-3.1-8b"


async def test_model_alias_in_an_upload(make_standin, make_gateway):
    """The alias is rewritten in the streamed form (its Content-Length follows), the file
    arrives intact."""
    s = await make_standin(models=["whisper-large-v3"])
    gw = await make_gateway({**fleet(("a", s)), "model_aliases": {"whisper-1": "whisper-large-v3"}})
    payload, _ = await form(("model", "whisper-1"), ("file", b"x" * 10, "a.wav", "audio/wav"))
    async with aiohttp.ClientSession() as client:
        status, answer, _ = await call(client, "POST", gw.url + "/v1/audio/transcriptions",
                                       data=payload)
    assert status == 200, answer
    got = s.requests[-1]
    assert got["form"]["model"] == "whisper-large-v3"
    assert (got["file"]["size"] == 10
            and got["file"]["sha256"] == hashlib.sha256(b"x" * 10).hexdigest())


async def test_a_model_added_at_run_time_becomes_routable(make_standin, make_gateway):
    a, b = await make_standin(models=["llama"]), await make_standin(models=["qwen"])
    gw = await make_gateway({**fleet(("a", a), ("b", b)), "health": {"interval_s": 0.2}})
    body = {"model": "mistral", "input": "x"}
    async with aiohttp.ClientSession() as client:
        status, _, _ = await call(client, "POST", gw.url + "/v1/embeddings", body)
        assert status == 404
        b.behaviour.models.append("mistral")
        deadline = time.monotonic() + 2.0
        while (status := (await call(client, "POST", gw.url + "/v1/embeddings", body))[0]) != 200:
            assert status == 404 and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        picks = {(await call(client, "POST", gw.url + "/v1/embeddings", body))[2]
                 for _ in range(5)}
    assert picks == {"b"} and "mistral" not in seen(a)


# --- the route table and passthrough ---------------------------------------------------------
async def test_paths_outside_the_table_are_404_unless_passed_through(make_standin, make_gateway):
    s = await make_standin(tokens=5, gap=0.03)
    closed = await make_gateway(fleet(("a", s)))
    opened = await make_gateway({**fleet(("a", s)), "passthrough": ["/generate"]})
    sglang = {"text": "Once upon", "sampling_params": {"max_new_tokens": 3}}
    async with aiohttp.ClientSession() as client:
        for path in ("/generate", "/v1/files", "/v2/rerank", "/pooling"):
            status, payload, _ = await call(client, "POST", closed.url + path, {"model": "m"})
            assert_openai_error(payload, 404, status)
        assert s.requests == []
        status, payload, up = await call(client, "POST", opened.url + "/generate", sglang)
        assert status == 200 and up == "a", payload
        assert payload["text"] == "tok0 tok1 tok2 "
        assert payload["meta_info"]["completion_tokens"] == 3
        assert payload["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        async with client.post(opened.url + "/generate", json={**sglang, "stream": True}) as r:
            events = [event_json(e) for _, e in await read_events(r)]
        assert events[-1] == "[DONE]" and events[-2]["text"] == "tok0 tok1 tok2 "
        status, _, _ = await call(client, "GET", opened.url + "/generate")
        assert status == 405
    assert s.requests[0]["path"] == "/generate" and s.requests[0]["json"] == sglang


async def test_a_passthrough_stream_is_relayed_as_it_comes(make_standin, make_gateway):
    s = await make_standin(tokens=6, gap=0.04)
    gw = await make_gateway({**fleet(("a", s)), "passthrough": ["/generate"]})
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/generate", json={"text": "x", "stream": True}) as r:
            timed = await read_events(r)
    assert timed[-1][0] - timed[0][0] > 0.1


# --- the openai SDK --------------------------------------------------------------------------
async def test_openai_sdk_on_the_new_endpoints(make_standin, make_gateway):
    s = await make_standin(models=["m", "whisper"], tokens=5)
    gw = await make_gateway(fleet(("a", s)))
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-none", max_retries=0)
    try:
        emb = await client.embeddings.create(model="m", input=["one", "two"])
        assert [d.index for d in emb.data] == [0, 1] and emb.model == "m"
        async with aiohttp.ClientSession() as raw:        # the SDK asked for base64
            _, floats, _ = await call(raw, "POST", gw.url + "/v1/embeddings",
                                      {"model": "m", "input": ["one", "two"]})
        assert emb.data[1].embedding == pytest.approx(floats["data"][1]["embedding"], abs=1e-6)
        assert s.requests[0]["json"]["encoding_format"] == "base64"

        resp = await client.responses.create(model="m", input="hi")
        assert resp.output_text == "tok0 tok1 tok2 tok3 tok4 " and resp.status == "completed"
        follow = await client.responses.create(model="m", input="more",
                                               previous_response_id=resp.id)
        assert follow.previous_response_id == resp.id
        assert (await client.responses.retrieve(follow.id)).id == follow.id
        queued = await client.responses.create(model="m", input="x", background=True,
                                               extra_body={"x_standin": {"first_delay": 5}})
        assert queued.status == "queued"
        assert (await client.responses.cancel(queued.id)).status == "cancelled"

        deltas, done = [], None
        async for event in await client.responses.create(model="m", input="hi", stream=True):
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                done = event.response
        assert "".join(deltas) == done.output_text == "tok0 tok1 tok2 tok3 tok4 "

        text = await client.audio.transcriptions.create(
            model="whisper", file=("speech.wav", MB2, "audio/wav"))
        assert text.text.startswith(f"heard {len(MB2)} bytes")
        entry = upload_record(s)
        assert entry["file"]["sha256"] == SHA_MB2 and entry["form"]["model"] == "whisper"
    finally:
        await client.close()
