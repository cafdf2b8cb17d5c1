"""Router↔engine parity: the prompt tokens prefix_route predicted the chosen upstream holds
cached, against the cached tokens that upstream's answer reports.

The prediction is the index's match for the upstream the request ran on (`Keys.matched`, set
when the policy scored the request: cache_aware and predicted_ttft, from the approximate or
the KV-event index; chwbl keeps no index and predicts nothing), taken on the first byte,
before the request itself is recorded in the index. In tokens:

- token keys: matched blocks × `block_tokens`, at most the blocks of the prompt less its last
  token (vLLM and the bundled engine always compute the last token, so a fully cached prompt
  reports one block less);
- text keys (no tokenizer): the matched share of the prompt's blocks × the prompt tokens the
  answer reports, under the same cap. Only a prompt the chain covers whole is compared (a chain
  cut at a dynamic value or at `max_blocks` has no share of the whole prompt).

The report is the answer's `usage` (proxy/observe/usage.py): `prompt_tokens_details.
cached_tokens` (OpenAI's APIs, vLLM), `cache_read_input_tokens` (Anthropic Messages). An
answer without a cached count (prefix caching off on vLLM reports none; a stream without
`stream_options.include_usage`), an error, and a P/D request (its prompt was computed on
another upstream than the one that answers) are not compared.

Metrics, labelled by upstream and model:
- `prefixgate_route_cache_prediction_error{direction}` — |reported − predicted| cached tokens,
  `direction` the sign: `fewer` (the engine held less than the router thought: eviction, a
  salt, caching off), `more` (its index missed what the engine holds: another tokenizer or
  template), `equal`. Absolute with a label, not signed: Prometheus clients drop a histogram's
  _sum when a bucket bound is negative, and the sums give the mean gap:
  (sum{more} − sum{fewer}) / count over all three;
- `prefixgate_route_cache_predictions_total{outcome}` — each comparison once: `agree`
  (|gap| < `large_gap_tokens`), else `hit_none` (a hit predicted, none reported), `none_hit`
  (none predicted, a hit reported), `fewer`, `more` (both hits, the gap large).
`prefixgate doctor` reads both (proxy/doctor/route_parity.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from prefixgate.common.schema import Key, positive
from prefixgate.proxy.observe import usage

SPEC = {
    "enabled": Key(bool, True),
    # three 16-token blocks: either side's block rounding and a text key's partial last block
    # stay below it, while a lost prefix or a template's extra preamble does not
    "large_gap_tokens": Key(int, 48, positive),
}

STATE_KEY = "prefix_route.parity"      # a request's Prediction (ctx.state)
OUTCOMES = ("agree", "hit_none", "none_hit", "fewer", "more")
# tokens apart; 0.5 sets exact agreement apart, 16 is one vLLM block
ERROR_BUCKETS = (0.5, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(slots=True)
class Prediction:
    upstream: str
    mode: str                 # the keys' mode: "tokens" or "text"
    matched: int              # leading blocks the index gave the upstream
    blocks: int               # the prompt's blocks (its chain)
    prompt: int | None        # tokens mode: the prompt's token count as the gateway has it


class Parity:
    """Predict on the first byte (`predict`), compare when the request ends (`compare`)."""

    def __init__(self, registry, cfg: dict):
        self.block_tokens = cfg["block_tokens"]
        self.max_blocks = cfg["max_blocks"]
        self.large_gap = cfg["parity"]["large_gap_tokens"]
        self.errors = Histogram(
            "prefixgate_route_cache_prediction_error", "|Cached prompt tokens the upstream "
            "reported - those prefix_route predicted it held|, direction: more (reported "
            "more), fewer, equal (requests whose answer reports cached tokens)",
            ["upstream", "model", "direction"], buckets=ERROR_BUCKETS, registry=registry)
        self.outcomes = Counter(
            "prefixgate_route_cache_predictions", "Predicted vs reported cached tokens: agree "
            "(gap below large_gap_tokens), hit_none (hit predicted, none reported), none_hit "
            "(none predicted, hit reported), fewer, more", ["upstream", "model", "outcome"],
            registry=registry)

    def predict(self, ctx, keys, up) -> None:
        """What the index said `up` holds of this request's prompt, kept for `compare`."""
        if keys.matched is None or not keys.chain or ctx.prefill_upstream is not None:
            return              # not scored from an index (chwbl, one candidate), or P/D
        if keys.mode == "text" and (keys.cut or len(keys.chain) >= self.max_blocks):
            return              # the chain does not cover the whole prompt: no share of it
        prompt = len(ctx.tokens) if ctx.tokens is not None else None
        ctx.state[STATE_KEY] = Prediction(up.name, keys.mode, keys.matched.get(up.name, 0),
                                          len(keys.chain), prompt)

    def compare(self, ctx, error) -> None:
        p = ctx.state.get(STATE_KEY)
        if p is None or error is not None or ctx.status != 200 or ctx.upstream is None \
                or ctx.upstream.name != p.upstream:
            return
        answer = ctx.usage
        if answer is None and ctx.tail:
            answer = (usage.from_stream(ctx.tail) or {}).get("usage")
        prompt, reported, _ = usage.tokens(answer)
        if reported is None or (prompt is None and p.prompt is None):
            return              # the upstream reports no cached count: nothing to compare
        predicted = self.predicted_tokens(p, prompt)
        model, gap = ctx.model or "", reported - predicted
        direction = "more" if gap > 0 else "fewer" if gap < 0 else "equal"
        self.errors.labels(p.upstream, model, direction).observe(abs(gap))
        self.outcomes.labels(p.upstream, model, self.outcome(predicted, reported)).inc()

    def predicted_tokens(self, p: Prediction, reported_prompt: int | None) -> int:
        """The prediction in tokens (module doc), capped as the engines cap their hits."""
        bt = self.block_tokens
        prompt = p.prompt if p.prompt is not None else reported_prompt
        usable = max(prompt - 1, 0)
        if p.mode == "tokens":
            return min(p.matched * bt, usable // bt * bt)
        return min(p.matched * prompt // p.blocks, usable)

    def outcome(self, predicted: int, reported: int) -> str:
        if abs(reported - predicted) < self.large_gap:
            return "agree"
        if reported == 0:
            return "hit_none"
        if predicted == 0:
            return "none_hit"
        return "fewer" if reported < predicted else "more"
