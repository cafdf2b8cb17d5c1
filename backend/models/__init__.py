"""Model architectures the engine can run. All supported families share the Llama layout."""
from __future__ import annotations

from torch import nn

from prefixgate.backend.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM", "build_model"]


def build_model(config: LlamaConfig) -> nn.Module:
    """An uninitialised model for `config`; build it under `torch.device("meta")`, then load the
    weights."""
    return LlamaForCausalLM(config)
