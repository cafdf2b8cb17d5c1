"""Plugin test helpers: a normalizer built from its YAML mapping, a plain chat template, the
turns of a tenant's conversation for the KV-event routing tests, and reading a gateway's route
decisions and /metrics."""
from __future__ import annotations

import asyncio
import re
import time

from prometheus_client.parser import text_string_to_metric_families

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


async def route(client, gw, messages, model: str = "standin-model",
                **fields) -> tuple[str, str]:
    """(upstream, outcome) of one chat request through the gateway."""
    async with client.post(gw.url + "/v1/chat/completions",
                           json={"model": model, "messages": messages, **fields}) as r:
        body = await r.read()
        assert r.status == 200, (r.status, body[:500])
        header = r.headers["x-prefixgate-route"]
        return r.headers["x-prefixgate-upstream"], re.search(r"outcome=(\w+)", header).group(1)


async def metrics(client, gw) -> dict:
    """{(sample name, sorted labels): value} from the gateway's /metrics."""
    async with client.get(gw.url + "/metrics") as r:
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


async def until(client, gw, cond, timeout=5.0) -> dict:
    """Poll /metrics until `cond(metrics)` holds; the metrics that made it hold."""
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(client, gw)
        if cond(m):
            return m
        assert time.monotonic() < deadline, "condition not reached; metrics: " + repr(
            {k: v for k, v in m.items() if "kv_" in k[0]})
        await asyncio.sleep(0.02)


def up(m, name) -> bool:
    return sample(m, "prefixgate_route_kv_events_up", upstream=name) == 1.0


def blocks(m, name) -> float:
    return sample(m, "prefixgate_route_kv_index_blocks", upstream=name)


class Recorder:
    """A plugin (`tests.plugins.helpers:Recorder` in a chain) that keeps the RequestContext of
    every request it sees, as the plugins before it left it."""
    name = "recorder"
    seen: list = []

    def __init__(self, cfg, gw):
        self.weight = 1.0

    async def on_request(self, ctx):
        Recorder.seen.append(ctx)
