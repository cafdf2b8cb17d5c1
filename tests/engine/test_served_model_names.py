"""The engine's model names and tokenizer endpoints, as vLLM has them: `--served-model-name`
with several names (all answered to, the first reported), vLLM's 404 for any other model,
`/tokenize` (prompt and chat forms) and `/detokenize`, against the real server."""
from __future__ import annotations

import aiohttp
import openai
import pytest

from prefixgate.backend.cli import build_parser, engine_args, main
from prefixgate.backend.server import LONG_TEXT_CHARS
from prefixgate.common.tokenizer import Tokenizer
from tests.helpers import VOCAB_SIZE, ServerThread

MAX_LEN = 1024
NAMES = ["tiny", "tiny-alias"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
NOT_FOUND = {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                       "param": "model", "code": 404}}


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(["--model", str(model_dir), "--max-model-len", str(MAX_LEN),
                       "--served-model-name", *NAMES]) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
async def client(server):
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def post(server, path, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + path, json=body) as r:
            return r.status, await r.json()


# --- names ------------------------------------------------------------------------------------

async def test_models_lists_every_served_name(server, model_dir):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/v1/models") as r:
            data = await r.json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == NAMES
    for card in data["data"]:
        assert set(card) == {"id", "object", "created", "owned_by", "root", "parent",
                             "max_model_len"}
        assert card["object"] == "model" and card["parent"] is None
        assert card["root"] == str(model_dir) and card["max_model_len"] == MAX_LEN


async def test_every_name_is_served_and_the_first_is_reported(client, server):
    kwargs = dict(max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    for name in NAMES:
        chat = await client.chat.completions.create(model=name, messages=MESSAGES, **kwargs)
        text = await client.completions.create(model=name, prompt="Hello", **kwargs)
        assert chat.model == text.model == "tiny"          # vLLM: the first --served-model-name
    # no model at all is served too (vLLM uses the default)
    status, data = await post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200 and data["model"] == "tiny"


def test_served_model_name_flag():
    assert build_parser().parse_args([]).served_model_name is None      # the dir name, or "demo"
    ns = build_parser().parse_args(["--served-model-name", "a", "b"])
    assert ns.served_model_name == ["a", "b"] and engine_args(ns).served_model_name == "a"


def test_an_empty_served_name_is_refused(model_dir, capsys):
    assert main(["--model", str(model_dir), "--served-model-name", "", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "--served-model-name" in err and "Traceback" not in err


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
    ("/v1/completions", {"prompt": "Hello"}),
    ("/tokenize", {"prompt": "Hello"}),
    ("/detokenize", {"tokens": [5, 6]}),
])
async def test_unknown_model_is_vllms_404(server, path, body):
    status, data = await post(server, path, {"model": "nope", **body})
    assert status == 404 and data == NOT_FOUND


async def test_unknown_model_raises_not_found_in_the_sdk(client):
    with pytest.raises(openai.NotFoundError) as chat:
        await client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as text:
        await client.completions.create(model="nope", prompt="Hello", max_tokens=2, stream=True)
    for e in (chat.value, text.value):
        assert e.status_code == 404 and e.type == "NotFoundError" and e.param == "model"
        assert "The model `nope` does not exist." in e.message


# --- /tokenize, /detokenize -------------------------------------------------------------------

async def test_tokenize_prompt_matches_the_tokenizer_and_usage(server, client, tok):
    prompt = "The quick brown fox, café 🙂"
    status, data = await post(server, "/tokenize", {"model": "tiny-alias", "prompt": prompt})
    ids = tok.encode(prompt, add_special_tokens=True)
    assert status == 200 and data == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                                      "token_strs": None}
    used = await client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert used.usage.prompt_tokens == data["count"]
    _, strs = await post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert strs["tokens"] == ids
    assert strs["token_strs"] == [tok._tok.id_to_token(i) for i in ids] and all(strs["token_strs"])


async def test_tokenize_chat_matches_the_chat_endpoint(server, client, tok):
    status, data = await post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES})
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert status == 200 and data["tokens"] == ids and data["count"] == len(ids)
    used = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert used.usage.prompt_tokens == data["count"]
    # content parts render as the chat endpoint renders them
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                         {"type": "text", "text": "there!"}]}]
    assert (await post(server, "/tokenize", {"messages": parts}))[1]["tokens"] == ids
    # without the generation prompt
    _, bare = await post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False,
                                               "chat_template_kwargs": {"unused": 1}})
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert bare["tokens"] == tok.encode(rendered)
    assert bare["count"] < data["count"]


async def test_continue_final_message_leaves_it_open(server, tok):
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    status, data = await post(server, "/tokenize", {"messages": messages,
                                                    "add_generation_prompt": False,
                                                    "continue_final_message": True})
    assert status == 200
    text = tok.decode(data["tokens"], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nThe answer is")


async def test_detokenize_round_trips(server, tok):
    for body in ({"prompt": "Hello there! 你好，世界 🚀"}, {"messages": MESSAGES}):
        _, toks = await post(server, "/tokenize", body)
        status, data = await post(server, "/detokenize",
                                  {"model": "tiny", "tokens": toks["tokens"]})
        expected = (body.get("prompt")
                    or tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
        assert status == 200 and data == {"prompt": expected}       # special tokens kept
    assert await post(server, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


async def test_long_prompts_tokenize_off_the_loop_the_same(server, tok):
    prompt = "The quick brown fox jumps over the lazy dog. " * (LONG_TEXT_CHARS // 40)
    status, data = await post(server, "/tokenize", {"prompt": prompt})
    assert status == 200 and data["tokens"] == tok.encode(prompt, add_special_tokens=True)
    # counted, not refused: the caller compares with max_model_len
    assert data["count"] > MAX_LEN
    status, back = await post(server, "/detokenize", {"tokens": data["tokens"]})
    assert status == 200 and back["prompt"] == prompt


@pytest.mark.parametrize("path,body,needle", [
    ("/tokenize", {}, "'prompt'"),
    ("/tokenize", {"prompt": 5}, "'prompt'"),
    ("/tokenize", {"prompt": [1, 2]}, "'prompt'"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "not both"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "'add_special_tokens'"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "'return_token_strs'"),
    ("/tokenize", {"messages": []}, "'messages'"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, "'messages'"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": [1]}, "'chat_template_kwargs'"),
    ("/tokenize", {"messages": MESSAGES, "tools": {"a": 1}}, "'tools'"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "Cannot set both"),
    ("/tokenize", {"messages": [{"role": "user", "content": None}], "add_generation_prompt": False,
                   "continue_final_message": True}, "final message"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role"),
    ("/tokenize", {"model": 5, "prompt": "x"}, "'model'"),
    ("/detokenize", {}, "'tokens'"),
    ("/detokenize", {"tokens": "abc"}, "'tokens'"),
    ("/detokenize", {"tokens": [1, "a"]}, "'tokens'"),
    ("/detokenize", {"tokens": [1, True]}, "'tokens'"),
    ("/detokenize", {"tokens": [1, 2.5]}, "'tokens'"),
    ("/detokenize", {"tokens": [-1]}, f"-1 is outside the vocabulary [0, {VOCAB_SIZE})"),
    ("/detokenize", {"tokens": [5, VOCAB_SIZE]}, f"{VOCAB_SIZE} is outside the vocabulary"),
    ("/detokenize", {"tokens": [2**70]}, "outside the vocabulary"),
    ("/v1/completions", {"model": ["tiny"], "prompt": "x"}, "'model'"),
])
async def test_bad_requests_get_openai_400s(server, path, body, needle):
    status, data = await post(server, path, body)
    assert status == 400, data
    assert set(data["error"]) == {"message", "type", "code"}
    assert needle in data["error"]["message"] and "Traceback" not in data["error"]["message"]


async def test_tokenize_bad_json_is_a_400(server):
    async with aiohttp.ClientSession() as s:
        for path in ("/tokenize", "/detokenize"):
            async with s.post(server.url + path, data=b"{nope") as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
