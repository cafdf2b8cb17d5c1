"""Tokenizer and chat template for a Hugging Face model directory, without transformers or torch.

The gateway's prerender plugin imports this module too, so it stays light: `tokenizers` for the
tokenizer.json, jinja2's ImmutableSandboxedEnvironment for the chat template (templates come
from model repos and are untrusted code), and the same template globals transformers provides
(`raise_exception`, `tojson`, `strftime_now`, special-token variables), so rendering matches
`transformers`' `apply_chat_template` byte for byte.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The chat template could not be rendered for these messages (its message says why)."""


class TokenizerLoadError(ValueError):
    """The model directory or GGUF file lacks a usable tokenizer."""


# --- chat template environment ---------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only
    render it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() refusing underscore attributes, so templates cannot reach CPython internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox turns an unsafe attribute into a silent empty value; we stop the render."""

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_TemplateNamespace,
        dict=_TemplateDict(),
    )
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"chat template has a syntax error on line {e.lineno}: {e.message}"
        ) from None


def _plain(value):
    """Rebuild inputs from plain JSON types so templates see no objects with callable methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    raise ChatTemplateError(f"chat template inputs must be JSON data, got {type(value).__name__}")


def _alias_reasoning(message: dict) -> dict:
    # As transformers does: templates read `reasoning_content`, gpt-oss ones read `thinking`.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# --- the tokenizer ---------------------------------------------------------------------------


def _token_content(value) -> str | None:
    """Special tokens appear as "<s>" or as {"content": "<s>", ...} (a serialised AddedToken)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerLoadError(f"{path} is not valid JSON: {e}") from None


def _as_id_list(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict, chat_template, eos_ids_extra=()):
        self._tok = tokenizer
        self.special_tokens = {k: _token_content(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        self.special_tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        if isinstance(extra, list):
            self.special_tokens["additional_special_tokens"] = [_token_content(t) for t in extra]
        self.chat_template = chat_template  # str, {name: str}, or None
        self.bos_token_id = self._id_of("bos_token")
        eos = {self._id_of("eos_token"), *eos_ids_extra}
        self.eos_token_ids: set[int] = {i for i in eos if i is not None}
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Whether encode(add_special_tokens=True) puts a BOS first, so encode can avoid a
        # second one when the text (a rendered chat template, say) already starts with it.
        self._adds_bos = (self.bos_token_id is not None and tokenizer.encode(
            "", add_special_tokens=True).ids[:1] == [self.bos_token_id])

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """A model directory (tokenizer.json) or a .gguf file (its tokenizer metadata)."""
        path = Path(path)
        if path.is_dir():
            return cls.from_dir(path)
        if path.suffix == ".gguf":
            return cls.from_gguf(path)
        raise TokenizerLoadError(f"{path} is neither a model directory with tokenizer.json nor "
                                 f"a .gguf file")

    @classmethod
    def from_gguf(cls, source) -> Tokenizer:
        """From a GGUF file's metadata; `source` is its path or an open `gguf.GGUFReader` (the
        engine opens the file once for weights and tokenizer alike)."""
        from gguf import GGUFReader

        from prefixgate.common.gguf_file import GGUFError, open_gguf
        from prefixgate.common.gguf_tokenizer import read_tokenizer

        try:
            reader = source if isinstance(source, GGUFReader) else open_gguf(source)
            found = read_tokenizer(reader)
        except GGUFError as e:
            raise TokenizerLoadError(str(e)) from None
        return cls(found.tokenizer, found.special_tokens, found.chat_template,
                   found.extra_eos_ids)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerLoadError(f"no tokenizer.json in {model_dir}")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerLoadError(f"{path} could not be loaded: {e}") from None
        config = {**_read_json(model_dir / "special_tokens_map.json"),
                  **_read_json(model_dir / "tokenizer_config.json")}
        template = config.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"  # transformers 5 writes the template here
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        # a list: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}
        eos_extra = [
            *_as_id_list(_read_json(model_dir / "generation_config.json").get("eos_token_id")),
            *_as_id_list(_read_json(model_dir / "config.json").get("eos_token_id")),
        ]
        return cls(tok, config, template, eos_extra)

    def _id_of(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return self._tok.token_to_id(token) if token else None

    # text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._adds_bos and ids[1:2] == [self.bos_token_id]:
            return ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # chat

    def template_source(self, tools=None) -> str:
        t = self.chat_template
        if isinstance(t, dict):
            name = "tool_use" if tools and "tool_use" in t else "default"
            if name not in t:
                raise ChatTemplateError(f"no default chat template among {sorted(t)}")
            return t[name]
        if not t:
            raise ChatTemplateError(
                "this model has no chat template; use /v1/completions with a raw prompt"
            )
        return t

    def apply_chat_template(
        self, messages, tools=None, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render messages with the model's template, as transformers'
        apply_chat_template(tokenize=False)."""
        template = compile_chat_template(self.template_source(tools))
        messages = [_alias_reasoning(m) for m in _plain(messages)]
        if not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("every message must be an object with a role")
        variables = {**self.special_tokens, **_plain(kwargs)}
        variables.setdefault("documents", None)
        try:
            return template.render(
                messages=messages, tools=_plain(tools), add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(
                f"chat template tried an unsafe operation and was stopped: {e}"
            ) from None
        except jinja2.exceptions.TemplateError as e:  # the template's raise_exception(...) too
            raise ChatTemplateError(f"chat template error: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e!r}") from None


class IncrementalDecoder:
    """Turns a stream of token ids into text that is safe to send as it arrives.

    Byte-level tokens can end mid-character, and some tokenizers change how a token reads
    depending on its neighbours, so each new piece is decoded together with a few tokens of
    context and held back while it ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this are already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        context = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if text.endswith("\ufffd") or len(text) <= len(context):
            return ""  # wait: a character is still incomplete, or nothing visible was added
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(context):]

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (e.g. a cut-off character, as U+FFFD)."""
        context = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(context):]
