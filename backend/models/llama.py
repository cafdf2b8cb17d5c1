"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a paged KV cache.

Reads top to bottom like the paper: config, RMSNorm, rotary embedding, attention with grouped
KV heads, SwiGLU MLP, decoder layer, model. Parameter names are exactly Hugging Face's, so a
checkpoint's state dict loads without renaming. The forward pass takes a flattened batch (all
new tokens of all sequences in this step, concatenated) and returns hidden states; logits are
computed separately and only for the rows the sampler needs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from prefixgate.backend import cpu_ops
from prefixgate.backend.attention import AttentionMetadata, paged_attention
from prefixgate.common.schema import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or Llama-3: {"rope_type": "llama3", factor, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v carry a bias (Qwen2); Llama's flag also covers o_proj
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> LlamaConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError("", f"{path} not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError("", f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> LlamaConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError("", f"model_type {model_type!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(raw.get(key), int):
                raise ConfigError("config.json", f"{key} is missing or not an integer")
        if raw.get("mlp_bias"):
            raise ConfigError("config.json", "mlp_bias is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError("config.json",
                              f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        heads = raw["num_attention_heads"]
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        values["num_key_value_heads"] = raw.get("num_key_value_heads") or heads
        values["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // heads
        values["attention_bias"] = bool(raw.get("attention_bias", model_type == "qwen2"))
        values["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype")
        values["rope_theta"], values["rope_scaling"] = _rope_settings(raw)
        values["max_position_embeddings"] = _context_limit(raw)
        if heads % values["num_key_value_heads"]:
            raise ConfigError("config.json", "num_attention_heads must be a multiple of "
                                              "num_key_value_heads")
        return cls(**values)


def _rope_settings(raw: dict) -> tuple[float, dict | None]:
    """rope_theta and scaling, from the classic keys or transformers 5's `rope_parameters`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError("config.json",
                          f"rope type {rope_type!r} is not supported (default or llama3)")
    needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in needed if k not in params]
    if missing:
        raise ConfigError("config.json", f"llama3 rope scaling lacks {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: params[k] for k in needed}}


def _context_limit(raw: dict) -> int:
    """Usable context. A sliding window (Mistral v0.1) caps it: this engine attends to
    everything."""
    limit = int(raw.get("max_position_embeddings") or 4096)
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", raw.get("model_type") == "mistral")
    if uses_window and isinstance(window, int) and window < limit:
        limit = window
    return limit


# --- building blocks -------------------------------------------------------------------------


def fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One linear layer computing `parts` side by side: their outputs, concatenated, from one
    matrix product (one pass over the input, one call's overhead instead of several)."""
    out_features = sum(p.out_features for p in parts)
    has_bias = parts[0].bias is not None
    fused = nn.Linear(parts[0].in_features, out_features, bias=has_bias, device="meta")
    weight = torch.cat([p.weight for p in parts])
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual += x` in place, then the norm of the sum (one pass on a CPU in bf16)."""
        return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """Per-pair rotation speeds; Llama-3 scaling slows the low frequencies for long context."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        # Built on CPU explicitly (even under a meta-device context) and not saved in checkpoints.
        inv_freq = rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position's angles, fp32 [T, head_dim / 2] (both halves of a
        head turn by the same angles)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        o_bias = bias and config.model_type != "qwen2"  # Qwen2 biases q/k/v only
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.qkv_proj: nn.Module | None = None     # fuse_projections(): one GEMM for q, k, v

    def fuse_projections(self) -> None:
        self.qkv_proj = fused_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        T, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_proj is None:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        else:
            qkv = self.qkv_proj(x)
        qkv = qkv.view(T, heads + 2 * kv_heads, self.head_dim)
        cpu_ops.rope_(qkv, heads + kv_heads, cos, sin)          # q and k rotated in one pass
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(T, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # fuse_projections(): one GEMM for both

    def fuse_projections(self) -> None:
        self.gate_up_proj = fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(cpu_ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, meta, kv_cache):
        """x: the previous layer's output (the embeddings at the first layer, where residual is
        None); residual: the stream it is added to. Returns this layer's output and the stream:
        each add is done together with the norm that follows it (vLLM's layout)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, cos, sin, meta, kv_cache)
        h = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        # Handing in the (empty) weight skips random init: every weight comes from the checkpoint,
        # and normal_() on the meta device would pull in torch._dynamo (a second of start-up).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # on a CPU, the layers of a decode step in one compiled call (cpu_decode_layers.py)
        self.decode_layers = None

    def forward(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rotary_emb(positions)
        if self.decode_layers is not None and self.decode_layers.takes(x, meta, kv_caches):
            x, residual = self.decode_layers(x, cos, sin, meta, kv_caches)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, cos, sin, meta, kv_cache)
        return self.norm.add_and_norm(x, residual)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models reuse the embedding matrix; no separate (and unloadable) head parameter.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )
        self.cpu_head: nn.Module | None = None   # a tied head as prepared for a CPU (cpu_linear.py)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_caches)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up each become one matrix product. After loading: checkpoints (and
        the state dict) keep Hugging Face's separate projections."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cpu_head is not None:
            return self.cpu_head(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()
