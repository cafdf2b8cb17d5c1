"""The built-in demo model, and the helpers that write a Hugging Face tokenizer directory.

`ensure_demo_model()` builds, once and in a few seconds, a small Llama-architecture model with
random (seeded) weights and a byte-level BPE tokenizer trained on the text in `backend/data/`.
Nothing is downloaded. The directory is a normal HF checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML template) that transformers loads too, plus
a SHA256SUMS manifest that every load verifies. Its name carries a fingerprint of the recipe,
so a changed recipe builds a fresh directory instead of reusing a stale one.

The size (32.5M parameters, 6 layers, hidden 512, 4 query heads of 64 and 2 KV heads) is chosen
for TTFT experiments on a small CPU: a 2,400-token prefill takes about 0.6 s on two cores in
fp32, long enough to measure cache hits; attention is kept to a modest share of it, as in real
models; and the context (16,384) holds the 8,000-token prompts the benchmarks use.
The output is random text, by design.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from prefixgate.common.cache_root import cache_root

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split: words, single digits, punctuation runs, newlines, spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, as Qwen2 uses it; tools are listed in the system turn as JSON lines.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call these tools:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] != 'system' %}"
    "{%- if message['role'] not in ['user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE laid out like Qwen2's tokenizer.json: any UTF-8 text encodes, no unknowns.

    Matching Qwen2's normalizer and split exactly matters: transformers 5 rebuilds a qwen2
    model's tokenizer with those, and the two must agree token for token.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer_files(
    model_dir: str | Path,
    tok: Tokenizer,
    chat_template: str = CHATML_TEMPLATE,
    model_max_length: int = 8192,
) -> None:
    """tokenizer.json + tokenizer_config.json (ChatML specials, chat template) readable by HF."""
    model_dir = Path(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n")


# --- the demo model --------------------------------------------------------------------------

BUILD_VERSION = 2  # bump when the recipe below changes in a way the fingerprint cannot see
DEMO_SPEC = {
    "vocab_target": 4096,
    "hidden_size": 512,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    # few, narrow heads: attention stays a modest share of a long prefill, as in real models
    # (where hidden >> heads x context), so prefix-cache savings show as they would there
    "num_attention_heads": 4,
    "head_dim": 64,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "init_std": 0.02,
    "seed": 20240601,
}


def corpus_texts() -> list[str]:
    """The tokenizer's training text, kept in the package (backend/data/*.txt), in name order."""
    files = sorted(
        (f for f in resources.files("prefixgate.backend").joinpath("data").iterdir()
         if f.name.endswith(".txt")),
        key=lambda f: f.name,
    )
    return [f.read_text(encoding="utf-8") for f in files]


def fingerprint() -> str:
    h = hashlib.sha256(json.dumps({"v": BUILD_VERSION, "spec": DEMO_SPEC}, sort_keys=True).encode())
    h.update(CHATML_TEMPLATE.encode())
    for text in corpus_texts():
        h.update(text.encode())
    return h.hexdigest()[:12]


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the demo model dir, building it first if this recipe has not been built yet."""
    root = Path(cache_dir) if cache_dir else cache_root()
    target = root / f"demo-{fingerprint()}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-building-", dir=root))
    try:
        build_demo_model(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        staging.rename(target)  # atomic: readers never see a half-written model
    except OSError:
        if not (target / "config.json").is_file():  # a real failure, not a lost race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _paragraphs(texts: list[str]) -> list[str]:
    return [p for text in texts for p in text.split("\n\n") if p.strip()]


def build_demo_model(out: str | Path) -> None:
    """Write the demo checkpoint into `out` (deterministic: same bytes every time)."""
    out = Path(out)
    spec = DEMO_SPEC
    tok = train_bpe_tokenizer(_paragraphs(corpus_texts()), spec["vocab_target"])
    # pad rows to a multiple of 64, as real models do
    vocab_size = -(-tok.get_vocab_size() // 64) * 64
    eos_id = tok.token_to_id("<|im_end|>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": spec["max_position_embeddings"],
        "rms_norm_eps": spec["rms_norm_eps"],
        "rope_theta": spec["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
        "initializer_range": spec["init_std"],
        "torch_dtype": "float32",
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id}, indent=2) + "\n")
    write_tokenizer_files(out, tok, model_max_length=spec["max_position_embeddings"])
    _write_random_weights(out / "model.safetensors", config, spec)
    from prefixgate.backend.checkpoint_files import write_manifest

    write_manifest(out)  # so every load of the demo also exercises the integrity check


def _write_random_weights(path: Path, config: dict, spec: dict) -> None:
    import torch
    from safetensors.torch import save_file

    from prefixgate.backend.models import LlamaConfig, build_model

    with torch.device("meta"):
        meta_model = build_model(LlamaConfig.from_dict(config))
        shapes = {n: tuple(p.shape) for n, p in meta_model.named_parameters()}
    gen = torch.Generator().manual_seed(spec["seed"])
    # GPT-2 style: residual-branch outputs shrink with depth so activations stay O(1) in the stack.
    residual_std = spec["init_std"] / (2 * spec["num_hidden_layers"]) ** 0.5
    tensors = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shapes[name])
            continue
        residual = name.endswith(("o_proj.weight", "down_proj.weight"))
        std = residual_std if residual else spec["init_std"]
        tensors[name] = torch.randn(shapes[name], generator=gen) * std
    save_file(tensors, str(path), metadata={"format": "pt"})
