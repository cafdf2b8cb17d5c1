"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer`.

A GGUF has no tokenizer.json. llama.cpp stores the vocabulary, merges, scores, token types and
special token ids as `tokenizer.ggml.*` metadata and names its pre-tokenizer
(`tokenizer.ggml.pre`) instead of spelling out its regexes. The regexes and defaults below are
llama.cpp's (llama-vocab.cpp), so text splits as llama.cpp splits it: for SmolLM2 (`smollm`)
every digit is cut off before the GPT-2 regex runs, which transformers' GGUF converter omits.

Two vocabulary kinds (`tokenizer.ggml.model`):
  gpt2   byte-level BPE: tokens spelt in GPT-2's byte alphabet, merges given as "a b" strings.
  llama  SentencePiece-style BPE: "▁" for spaces, `<0xXX>` byte tokens for anything the
         vocabulary lacks, merges given or implied by the tokens' scores.

This module stays light (tokenizers, gguf; no torch, no transformers): the gateway loads it.
Failures are `GGUFError`s naming the key and value at fault.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from prefixgate.common.gguf_file import GGUFError, field

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
SPIECE_SPACE = "\u2581"

# --- llama.cpp's pre-tokenizer regexes, applied in order, each splitting the last one's pieces --

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_SPLITS = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "digits-then-gpt2": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}
# llama.cpp's tokenizer.ggml.pre names, for the families whose regexes are above:
# (names, split, ignore_merges: a piece already in the vocabulary skips BPE, add_bos default)
_PRE_FAMILIES = (
    (("default",), "default", False, False),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), "gpt2", False, False),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     "digits-then-gpt2", False, False),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     "llama3", True, True),
    (("dbrx", "smaug-bpe"), "llama3", False, False),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), "qwen2", False, False),
)
_PRE_TYPES = {name: rest for names, *rest in _PRE_FAMILIES for name in names}
SUPPORTED_PRE = tuple(sorted(_PRE_TYPES))
SUPPORTED_MODELS = ("gpt2", "llama")


class _BadTokenizer(ValueError):
    """Metadata that is present but unusable; read_tokenizer names the file."""


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF says about its tokenizer, in the shapes `common.tokenizer.Tokenizer` takes."""

    tokenizer: HFTokenizer
    special_tokens: dict[str, str]  # bos_token / eos_token / unk_token / pad_token -> text
    extra_eos_ids: tuple[int, ...]  # end-of-turn / end-of-message ids that also stop generation
    chat_template: str | None


def read_tokenizer(reader: GGUFReader) -> GGUFTokenizer:
    try:
        return _read(reader)
    except _BadTokenizer as e:
        raise GGUFError(f"{reader.data.filename}: {e}") from None


def _read(reader: GGUFReader) -> GGUFTokenizer:
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise _BadTokenizer(f"tokenizer.ggml.token_type has {len(types)} entries for "
                            f"{len(tokens)} tokens")
    if kind == "gpt2":
        tok, add_bos_default = _byte_level(reader, tokens, types)
    elif kind == "llama":
        tok, add_bos_default = _sentencepiece(reader, tokens), True
    else:
        raise _BadTokenizer(f"tokenizer.ggml.model {kind!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_MODELS)})")
    special_ids = _special_ids(reader, len(tokens))
    _add_special_tokens(tok, tokens, types, special_ids.values())
    specials = {name: tokens[i] for name, i in special_ids.items()}
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _bos_eos_processor(specials, special_ids, add_bos, add_eos)
    extra_eos = tuple(i for key in ("eot_token_id", "eom_token_id")
                      if (i := _token_id(reader, key, len(tokens))) is not None)
    template = field(reader, "tokenizer.chat_template", None)
    return GGUFTokenizer(tok, specials, extra_eos, template if isinstance(template, str) else None)


# --- gpt2: byte-level BPE --------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable bytes stand for themselves, the rest are moved
    to code points from 256 up, so every byte has a visible one-character spelling."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


def _byte_level(reader, tokens, types) -> tuple[HFTokenizer, bool]:
    pre = field(reader, "tokenizer.ggml.pre", "default") or "default"
    if pre not in _PRE_TYPES:
        raise _BadTokenizer(f"tokenizer.ggml.pre {pre!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_PRE)})")
    split, ignore_merges, add_bos_default = _PRE_TYPES[pre]
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def spelt(token: str, kind: int) -> str:
        # Added tokens match raw text; a normal token outside the alphabet (a converter's
        # slip) is respelt byte by byte, as transformers does.
        if kind in (UNKNOWN, CONTROL, USER_DEFINED) or set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelt(t, k): i for i, (t, k) in enumerate(zip(tokens, types))}
    merges = [_merge_pair(m) for m in field(reader, "tokenizer.ggml.merges")]
    tok = _bpe(vocab, merges, ignore_merges=ignore_merges)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS[split]),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok, add_bos_default


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise _BadTokenizer(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
    return left, right


# --- llama: SentencePiece-style BPE ----------------------------------------------------------


def _sentencepiece(reader, tokens) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    given = field(reader, "tokenizer.ggml.merges", None)
    if given is not None:
        merges = [_merge_pair(m) for m in given]
    else:
        merges = _merges_from_scores(tokens, field(reader, "tokenizer.ggml.scores"), vocab)
    unk = _token_id(reader, "unknown_token_id", len(tokens))
    tok = _bpe(vocab, merges, byte_fallback=True,
               unk_token=tokens[unk] if unk is not None else None)
    # SentencePiece's own normalisation (as llama.cpp does it): spaces become "▁" and, unless
    # the file says not to, a "▁" starts the text and every stretch after a special token.
    space_prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", SPIECE_SPACE)
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), escape])
                      if space_prefix else escape)
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(
        [*steps, decoders.Strip(content=" ", left=1)] if space_prefix else steps)
    return tok


def _merges_from_scores(tokens, scores, vocab) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, ordered as transformers' GGUF converter
    orders them: every split of a token into two vocabulary tokens is a merge; merges rank by
    the whole token's score, then by longer left and right parts (best first); splits of one
    token are ordered by the parts' ids; ties keep vocabulary order."""
    if len(scores) != len(tokens):
        raise _BadTokenizer(f"tokenizer.ggml.scores has {len(scores)} entries for "
                            f"{len(tokens)} tokens")
    score_of = dict(zip(tokens, scores))  # the first spelling's place, its last score
    candidates = []
    for token, score in score_of.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = sorted((pair for pair in splits if pair[0] in vocab and pair[1] in vocab),
                        key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((-score, -len(left), -len(right), left, right)
                          for left, right in splits)
    candidates.sort(key=lambda c: c[:3])
    return [(left, right) for *_, left, right in candidates]


# --- shared parts ----------------------------------------------------------------------------


def _bpe(vocab, merges, **options) -> HFTokenizer:
    try:
        return HFTokenizer(BPE(vocab=vocab, merges=merges, **options))
    except Exception as e:  # tokenizers raises plain Exceptions for a merge of unknown tokens
        raise _BadTokenizer(
            f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}") from None


def _token_id(reader, key: str, vocab_size: int) -> int | None:
    value = field(reader, f"tokenizer.ggml.{key}", None)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < vocab_size:
        raise _BadTokenizer(f"tokenizer.ggml.{key} {value!r} is not a token id "
                            f"(the vocabulary has {vocab_size:,} tokens)")
    return value


def _special_ids(reader, vocab_size: int) -> dict[str, int]:
    keys = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    ids = {name: _token_id(reader, key, vocab_size) for name, key in keys.items()}
    return {name: i for name, i in ids.items() if i is not None}


def _add_special_tokens(tok: HFTokenizer, tokens, types, special_ids) -> None:
    """Control and unknown tokens (and the named special ones) match whole in text and are
    skipped by decode(skip_special_tokens=True); user-defined ones match whole but are plain
    text, as llama.cpp's tokenize(special=True) treats them."""
    special = {i for i, kind in enumerate(types) if kind in (UNKNOWN, CONTROL)}
    special.update(special_ids)
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])


def _bos_eos_processor(specials, ids, add_bos: bool, add_eos: bool):
    """encode(..., add_special_tokens=True) adds BOS/EOS where the file (or llama.cpp's
    default for its vocabulary) says so."""
    bos, eos = add_bos and "bos_token" in ids, add_eos and "eos_token" in ids
    if not (bos or eos):
        return None
    # Placeholder names, not the tokens' text: a template string cannot hold a ":".
    single = ["BOS"] * bos + ["$A"] + ["EOS"] * eos
    named = [("BOS", "bos_token")] * bos + [("EOS", "eos_token")] * eos
    return processors.TemplateProcessing(single=single, special_tokens=[
        {"id": place, "ids": [ids[name]], "tokens": [specials[name]]} for place, name in named])
