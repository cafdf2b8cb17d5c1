"""Our tokenizer + chat template against transformers, the sandbox, and streaming decode."""
from __future__ import annotations

import datetime
import json
import shutil

import pytest

from prefixgate.common.tokenizer import (
    ChatTemplateError,
    IncrementalDecoder,
    Tokenizer,
    TokenizerLoadError,
)
from tests.helpers import QWEN_STYLE_TEMPLATE, make_tiny_model

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "查询城市天气 / weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_and_turns": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 你好 means?"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris and Beijing?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "北京"}}},
        ]},
        {"role": "tool", "content": "{\"temp\": 18}"},
        {"role": "tool", "content": "{\"temp\": 25}"},
        {"role": "user", "content": "Thanks"},
    ],
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tok") / "m", "qwen2")


@pytest.fixture(scope="module")
def qwen_style_dir(tiny_dir, tmp_path_factory):
    """Same tokenizer; the template lives in chat_template.jinja as transformers 5 saves it."""
    d = shutil.copytree(tiny_dir, tmp_path_factory.mktemp("qwen") / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'this template must be ignored' }}"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").write_text(QWEN_STYLE_TEMPLATE)
    return d


def _hf(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# The tiny ChatML template has no tool_calls syntax, so it skips the tool round trip.
RENDER_CASES = [(which, name) for which in ("tiny", "qwen_style") for name in CONVERSATIONS
                if not (which == "tiny" and name == "tool_round_trip")]


@pytest.mark.parametrize("which,name", RENDER_CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_rendering_equals_transformers(request, which, name, add_generation_prompt, with_tools):
    model_dir = request.getfixturevalue(f"{which}_dir")
    messages, tools = CONVERSATIONS[name], TOOLS if with_tools else None
    ours = Tokenizer.from_dir(model_dir).apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt)
    theirs = _hf(model_dir).apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    if which == "qwen_style":
        assert "must be ignored" not in ours and "[latest]" in ours


def test_token_ids_equal_transformers(qwen_style_dir):
    messages = CONVERSATIONS["tool_round_trip"]
    ours = Tokenizer.from_dir(qwen_style_dir)
    ids = ours.encode(ours.apply_chat_template(messages, tools=TOOLS))
    assert ids == _hf(qwen_style_dir).apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert (ours.decode(ids, skip_special_tokens=False)
            == ours.apply_chat_template(messages, tools=TOOLS))


def test_special_token_variables_and_template_globals(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(
        "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ strftime_now('%Y') }}|"
        "{{ messages | tojson }}|{{ dict(a=1) | tojson }}"
        "{% for m in messages %}{% break %}{% endfor %}"
        "{% generation %}{{ custom }}{% endgeneration %}"
    )
    messages = [{"role": "user", "content": "é<tag>"}]
    ours = Tokenizer.from_dir(d).apply_chat_template(messages, custom="X")
    assert ours == _hf(d).apply_chat_template(messages, tokenize=False, custom="X",
                                              add_generation_prompt=True)
    year = datetime.datetime.now().strftime("%Y")
    assert ours == (f'<|im_end|>|<|endoftext|>|False|{year}|'
                    '[{"role": "user", "content": "é<tag>"}]|{"a": 1}X')


def test_raise_exception_becomes_a_clear_error(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set ns = namespace() %}{% set ns._hidden = 1 %}{{ ns._hidden }}",
    "{{ messages.append({'role': 'x'}) }}",  # the sandbox is immutable: no mutating inputs
    "{{ raise_exception.__globals__ }}",
]


@pytest.mark.parametrize("template", SANDBOX_ESCAPES)
def test_sandbox_escape_attempts_are_stopped(tiny_dir, tmp_path, template):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    marker = tmp_path / "escaped"
    (d / "chat_template.jinja").write_text(template.replace("{marker}", str(marker)))
    with pytest.raises(ChatTemplateError, match="unsafe|not allowed|undefined"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])
    assert not marker.exists()


def test_template_syntax_error_is_reported_with_line(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("ok\n{% for m in messages %}\n{{ m }")
    with pytest.raises(ChatTemplateError, match="syntax error on line 3"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])


def test_named_templates_pick_tool_use_when_tools_given(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain"},
                               {"name": "tool_use", "template": "tools:{{ tools | length }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([]) == "plain"
    assert tok.apply_chat_template([], tools=TOOLS) == "tools:1"


def test_eos_ids_gather_every_source(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    tok = Tokenizer.from_dir(d)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == {im_end}
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    assert Tokenizer.from_dir(d).eos_token_ids == {im_end, eot}
    assert tok.bos_token_id is None


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", [
    "你好，世界！今天天气很好。",
    "Rockets 🚀🚀 and sparkles ✨ with a family 👨‍👩‍👧 emoji.",
    "Mixed: café naïve über — 東京 — 😀 end",
])
def test_incremental_decoding_equals_full_decode(tiny_dir, text):
    tok = Tokenizer.from_dir(tiny_dir)
    special = tok.token_to_id("<|im_end|>")
    ids = tok.encode(text) + [special]
    assert len(ids) > len(text) // 2, "the tiny vocab should split characters into byte tokens"
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some tokens ended mid-character and were held back


def test_incremental_decoder_flushes_a_cut_off_character(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode("ok 🚀")
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    decoder = IncrementalDecoder(tok)
    streamed = "".join(decoder.push(i) for i in ids[:cut])
    assert "\ufffd" not in streamed
    assert streamed + decoder.flush() == tok.decode(ids[:cut])


def test_incremental_decoding_with_sentencepiece_style_spaces(tmp_path):
    """Llama-2/Mistral tokenizers mark spaces with '▁' and drop the first one on decode; a token
    decoded on its own would lose its space, so the decoder must decode with context."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = HFTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    corpus = ["the cat sat on the mat", "a streaming decoder keeps its spaces", "hello world"] * 5
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"],
                                  show_progress=False)
    raw.train_from_iterator(corpus, trainer)
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = Tokenizer.from_dir(tmp_path)
    text = "the streaming cat keeps hello world spaces"
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids + [tok.token_to_id("</s>")]]
    assert "".join(pieces) + decoder.flush() == tok.decode(ids) == text
    assert any(p.startswith(" ") for p in pieces)
    assert tok.eos_token_ids == {tok.token_to_id("</s>")}
