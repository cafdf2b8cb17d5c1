"""Doctor's check (r), router↔engine parity: which upstream's cached-token reports disagree
with what prefix_route predicted it held, read from the gateway's /metrics.

The gateway exports, per upstream and model, the gap |reported − predicted| with its
direction (`prefixgate_route_cache_prediction_error{direction}`, a histogram: its _sums and
_counts give the mean signed gap)
and each comparison's outcome (`prefixgate_route_cache_predictions_total{outcome}`:
plugins/prefix_route/parity.py). An upstream is named when enough of its requests were
compared and a large share of them came out far apart; the direction says what to suspect.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from prefixgate.proxy.doctor.checks import Finding

ERROR = "prefixgate_route_cache_prediction_error"
OUTCOMES = "prefixgate_route_cache_predictions_total"
MIN_COMPARED = 5            # requests compared before an upstream is judged
DISAGREE_SHARE = 0.25       # far-apart share that names an upstream (noise stays well below)

CAUSES_MORE = ("the router's keys are not the engine's: a different tokenizer or chat template "
               "on this upstream (one that adds a default system prompt or a date; with "
               "`index: kv_events` its events' tokens then never match the gateway's), an "
               "engine block size that is no multiple of `block_tokens`, or a changed block "
               "hash; serve the model with the gateway's tokenizer and template "
               "(`models.<name>.tokenizer`)")
CAUSES_LESS = ("the engine holds less than the router thinks: prefix caching off on this "
               "upstream, a `cache_salt` the router does not key by (or one that changes per "
               "request), a chat template that puts per-request content first, a restarted "
               "engine, or a KV cache smaller than `index_capacity` blocks")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class UpstreamParity:
    """One upstream's comparisons, summed over its models."""
    gap_sum: float = 0.0
    compared: float = 0.0
    outcomes: dict[str, float] = field(default_factory=dict)

    @property
    def mean_gap(self) -> float:
        return self.gap_sum / self.compared if self.compared else 0.0

    def share(self, *outcomes: str) -> float:
        total = sum(self.outcomes.values())
        return sum(self.outcomes.get(o, 0.0) for o in outcomes) / total if total else 0.0

    @property
    def far_apart(self) -> float:
        return 1.0 - self.share("agree") if self.outcomes else 0.0


def parse(text: str | None) -> dict[str, UpstreamParity]:
    """Upstream name -> its comparisons, from a gateway's Prometheus text."""
    out: dict[str, UpstreamParity] = {}
    for line in (text or "").splitlines():
        m = _SAMPLE.match(line)
        if m is None or not m.group(1).startswith("prefixgate_route_cache_predict"):
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        up = out.setdefault(labels.get("upstream", ""), UpstreamParity())
        name, value = m.group(1), float(m.group(3))
        if name == ERROR + "_sum":       # signed by its direction (more: +, fewer: −)
            up.gap_sum += -value if labels.get("direction") == "fewer" else value
        elif name == ERROR + "_count":
            up.compared += value
        elif name == OUTCOMES:
            outcome = labels.get("outcome", "")
            up.outcomes[outcome] = up.outcomes.get(outcome, 0.0) + value
    return {name: up for name, up in out.items() if up.compared}


def route_parity(text: str | None) -> list[Finding]:
    """A FAIL naming each upstream whose reports disagree, a PASS for the others."""
    title = "router↔engine parity"
    if text is None or ERROR not in text:
        return [Finding("r", title, "SKIP", "no prefixgate_route_cache_prediction_error in this "
                        "URL's /metrics: not a prefixgate gateway, or its prefix_route keeps no "
                        "index (policy: chwbl) or has `parity: {enabled: false}`")]
    fleet = parse(text)
    judged = {n: u for n, u in fleet.items() if u.compared >= MIN_COMPARED}
    if not judged:
        return [Finding("r", title, "SKIP", f"fewer than {MIN_COMPARED} requests compared per "
                        "upstream so far (only answers that report cached tokens count: vLLM "
                        "with prefix caching on, streams with stream_options.include_usage)",
                        data={"compared": {n: u.compared for n, u in fleet.items()}})]
    bad = {n: u for n, u in judged.items() if u.far_apart >= DISAGREE_SHARE}
    found = [_disagrees(n, u) for n, u in sorted(bad.items())]
    good = sorted(set(judged) - set(bad))
    if good:
        found.append(Finding("r", title, "PASS", "the router's predictions agree with "
                             + ", ".join(f"{n} ({_evidence(judged[n])})" for n in good),
                             data={"agree": {n: _data(judged[n]) for n in good}}))
    return found


def _disagrees(name: str, u: UpstreamParity) -> Finding:
    more = u.share("none_hit", "more") >= u.share("hit_none", "fewer")
    direction = "more cached than predicted" if more else "less cached than predicted"
    return Finding("r", f"router↔engine parity: {name}", "FAIL", f"upstream {name}'s cached "
                   f"tokens disagree with the router's predictions ({direction}): "
                   f"{_evidence(u)}", "likely causes: " + (CAUSES_MORE if more else CAUSES_LESS),
                   {"upstream": name, **_data(u)})


def _evidence(u: UpstreamParity) -> str:
    return (f"{u.compared:g} requests compared, mean gap {u.mean_gap:+.0f} tokens (reported − "
            f"predicted), {u.far_apart:.0%} far apart: {u.share('more', 'none_hit'):.0%} "
            f"reported more ({u.share('none_hit'):.0%} none predicted and a hit reported), "
            f"{u.share('fewer', 'hit_none'):.0%} reported fewer ({u.share('hit_none'):.0%} a "
            "hit predicted and none reported)")


def _data(u: UpstreamParity) -> dict:
    return {"compared": u.compared, "mean_gap": round(u.mean_gap, 1),
            "far_apart": round(u.far_apart, 3), "hit_none": round(u.share("hit_none"), 3),
            "none_hit": round(u.share("none_hit"), 3), "outcomes": u.outcomes}
