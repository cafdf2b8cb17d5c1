"""The tokenizer and chat template read from a GGUF's metadata, against transformers' GGUF
tokenizer and against llama.cpp's token ids (recorded in data/llama_cpp_ids.json by
data/gen_llama_cpp_ids.py: llama.cpp is not installed in CI).

transformers' GGUF converter drops SmolLM2's digit split (llama.cpp's `smollm` pre-tokenizer)
and, for SentencePiece vocabularies, the "▁" llama.cpp puts before a leading space and after a
special token; text that meets those cases is compared with llama.cpp's ids only.
"""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from prefixgate.common.gguf_file import open_gguf
from prefixgate.common.tokenizer import IncrementalDecoder, Tokenizer, TokenizerLoadError
from tests.engine.gguf_vocab import SPM_CONTROL, smollm2_path, write_spm_gguf, write_vocab_copy

LLAMA_CPP = json.loads((Path(__file__).parent / "data" / "llama_cpp_ids.json").read_text("utf-8"))
SMOLLM2_TEXTS = [case["text"] for case in LLAMA_CPP["smollm2"]]
SPM_TEXTS = LLAMA_CPP["spm"]["texts"]

CHATS = {
    "no_system": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "Answer in one word."},
               {"role": "user", "content": "Capital of France?"}],
    "multi_turn": LLAMA_CPP["smollm2_chat"]["messages"],
}


def _has_digit(text: str) -> bool:
    return any(unicodedata.category(ch).startswith("N") for ch in text)


def _spm_like_transformers(text: str) -> bool:
    return not text.startswith(" ") and "<" not in text


@pytest.fixture(scope="module")
def reader():
    return open_gguf(smollm2_path())


@pytest.fixture(scope="module")
def ours(reader):
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def theirs(offline):
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    write_spm_gguf(d / "spm.gguf")
    write_spm_gguf(d / "spm_no_prefix.gguf", add_space_prefix=False)
    write_spm_gguf(d / "spm_eos.gguf", add_bos=False, add_eos=True)
    return d


# --- SmolLM2: the real file ------------------------------------------------------------------


@pytest.mark.parametrize("case", LLAMA_CPP["smollm2"], ids=range(len(SMOLLM2_TEXTS)))
def test_smollm2_encodes_like_llama_cpp(ours, case):
    assert ours.encode(case["text"]) == case["ids"]


def test_the_corpus_is_varied():
    assert len(SMOLLM2_TEXTS) >= 20 and "\n\n1. First item\n2. Second item\n10. Tenth item" \
        in SMOLLM2_TEXTS
    assert sum(map(_has_digit, SMOLLM2_TEXTS)) >= 8
    assert sum(not _has_digit(t) for t in SMOLLM2_TEXTS) >= 20


@pytest.mark.parametrize("text", [t for t in SMOLLM2_TEXTS if not _has_digit(t)])
def test_smollm2_encodes_like_transformers_without_digits(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


def test_transformers_differs_on_digits_where_llama_cpp_splits_them(ours, theirs):
    text = "\n\n1."
    assert ours.encode(text) == [1116, 33, 30]  # "\n\n" stays one piece once "1" is cut off
    assert theirs.encode(text, add_special_tokens=False) == [198, 198, 33, 30]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm2_decodes_like_transformers(ours, theirs, skip_special_tokens):
    for case in LLAMA_CPP["smollm2"]:
        assert (ours.decode(case["ids"], skip_special_tokens)
                == theirs.decode(case["ids"], skip_special_tokens=skip_special_tokens))
        if not skip_special_tokens:
            assert ours.decode(case["ids"], False) == case["text"]


def test_streaming_decode_of_multibyte_text_equals_the_whole(ours):
    text = "你好 😀👍🏽 café — 👨‍👩‍👧‍👦"
    stream = IncrementalDecoder(ours)
    pieces = [stream.push(i) for i in ours.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_smollm2_special_tokens(ours):
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("<|im_start|>user", add_special_tokens=True)[:2] == [1, 4093]
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")  # add_bos false
    assert 2 in ours.eos_token_ids and ours.bos_token_id == 1
    assert ours.vocab_size == 49152
    assert ours.special_tokens["eos_token"] == "<|im_end|>"
    assert ours.decode([1, 4093, 2]) == "user"


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(ours, theirs, chat, add_generation_prompt):
    messages = CHATS[chat]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    default_system = "You are a helpful AI assistant named SmolLM"
    assert (default_system in rendered) == (messages[0]["role"] != "system")
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_rendered_chat_prompt_ids_equal_llama_cpp(ours):
    chat = LLAMA_CPP["smollm2_chat"]
    text = ours.apply_chat_template(chat["messages"], add_generation_prompt=True)
    assert text == chat["text"]
    assert ours.encode(text, add_special_tokens=True) == chat["ids"]
    assert chat["ids"][0] == 1 and chat["ids"].count(1) == 5  # one BOS-like <|im_start|> a turn


# --- other pre-tokenizers: SmolLM2's vocabulary under other names ------------------------------


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP["pre"]["ids"]))
def test_pre_tokenizer_splits_like_llama_cpp(reader, tmp_path, pre):
    cut = LLAMA_CPP["pre"]
    path = write_vocab_copy(reader, tmp_path / "v.gguf", cut["vocab_size"],
                            tuple(cut["extra"]), pre=pre)
    tok = Tokenizer.load(path)
    assert [tok.encode(text) for text in cut["texts"]] == cut["ids"][pre]


def test_pre_tokenizer_names_pick_different_splits():
    by_pre = LLAMA_CPP["pre"]["ids"]
    assert len({json.dumps(ids) for ids in by_pre.values()}) == len(by_pre)


# --- a SentencePiece-style (llama) vocabulary written here -----------------------------------


@pytest.fixture(scope="module")
def spm_theirs(spm_dir, offline):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(spm_dir), gguf_file="spm.gguf")


@pytest.mark.parametrize("text", [t for t in SPM_TEXTS if _spm_like_transformers(t)])
def test_spm_encodes_like_transformers(spm_dir, spm_theirs, text):
    ours = Tokenizer.load(spm_dir / "spm.gguf")
    assert ours.encode(text) == spm_theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == spm_theirs.encode(text)


def test_spm_decodes_like_transformers(spm_dir, spm_theirs):
    ours = Tokenizer.load(spm_dir / "spm.gguf")
    for ids in LLAMA_CPP["spm"]["ids"]["default"]:
        for skip in (True, False):
            assert ours.decode(ids, skip) == spm_theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name,file", [("default", "spm.gguf"),
                                       ("no_space_prefix", "spm_no_prefix.gguf")])
def test_spm_encodes_like_llama_cpp(spm_dir, name, file):
    ours = Tokenizer.load(spm_dir / file)
    assert [ours.encode(text) for text in SPM_TEXTS] == LLAMA_CPP["spm"]["ids"][name]


def test_spm_byte_fallback_special_tokens_and_bos(spm_dir):
    ours = Tokenizer.load(spm_dir / "spm.gguf")
    space = len(SPM_CONTROL) + 256  # "▁": the first piece after the control and byte tokens
    byte_ids = [len(SPM_CONTROL) + b for b in "😀".encode()]
    assert ours.encode("😀") == [space, *byte_ids] and ours.decode([space, *byte_ids]) == "😀"
    assert ours.encode("<s>") == [1] and ours.encode("<|tool|>") == [4]
    assert ours.decode([1, 4, 3, 2]) == "<|tool|>"  # user-defined: plain text, not skipped
    hello = ours.encode("Hello", add_special_tokens=True)
    assert hello[0] == 1 and hello[1] != 1  # add_bos defaults on for SentencePiece vocabularies
    assert ours.encode("<s>Hello", add_special_tokens=True) == hello  # never a second BOS
    assert ours.eos_token_ids == {2, 3}  # eos and end-of-turn


def test_spm_flags_for_bos_and_eos(spm_dir):
    ours = Tokenizer.load(spm_dir / "spm_eos.gguf")
    assert ours.encode("Hello", add_special_tokens=True) == [*ours.encode("Hello"), 2]


# --- what is refused ----------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("model", "bert"), ("pre", "klingon-bpe")])
def test_unknown_model_or_pre_is_named(reader, tmp_path, key, value):
    path = write_vocab_copy(reader, tmp_path / "v.gguf", 300, **{key: value})
    with pytest.raises(TokenizerLoadError) as e:
        Tokenizer.load(path)
    assert f"tokenizer.ggml.{key} {value!r} is not supported (supported: " in str(e.value)
    assert str(path) in str(e.value)


def test_load_accepts_a_directory_or_a_gguf_file_only(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(TokenizerLoadError, match="neither a model directory .* nor a .gguf"):
        Tokenizer.load(tmp_path / "model.bin")
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json in"):
        Tokenizer.load(tmp_path)
    (tmp_path / "broken.gguf").write_bytes(b"GGML" + b"\0" * 16)
    with pytest.raises(TokenizerLoadError, match="broken.gguf is not a GGUF file"):
        Tokenizer.load(tmp_path / "broken.gguf")
