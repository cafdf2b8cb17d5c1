"""Plugin test helpers: a normalizer built from its YAML mapping, a plain chat template, and
the turns of a tenant's conversation for the KV-event routing tests."""
from __future__ import annotations

from prefixgate.common.schema import check
from prefixgate.plugins.normalize.plugin import SPEC, Normalizer

# A chat template with no special tokens: the prompt is the messages' text, one per line.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def normalizer(**cfg) -> Normalizer:
    return Normalizer(check(cfg, SPEC))


def tenant(name: str) -> list[dict]:
    """A tenant's first turn: a long system prompt of its own (many 16-token blocks)."""
    system = f"You are the assistant of tenant {name}. " + f"Tenant {name} rules: be brief. " * 10
    return [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]


def follow_up(messages: list[dict]) -> list[dict]:
    return messages + [{"role": "assistant", "content": "an answer"},
                       {"role": "user", "content": "and a follow-up question"}]
