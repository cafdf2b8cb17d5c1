"""Read the few numbers `prefixgate doctor` needs from a server's Prometheus /metrics text,
whatever the server: vLLM, SGLang, llama.cpp, the bundled engine, or the gateway itself."""
from __future__ import annotations

import re

# what we look for -> metric names, first found wins (counters without their _total suffix)
ALIASES = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "prefixgate:kv_cache_usage_perc", "sglang:token_usage",
                 "llamacpp:kv_cache_usage_ratio"),
    "running": ("vllm:num_requests_running", "prefixgate:num_requests_running",
                "sglang:num_running_reqs", "llamacpp:requests_processing"),
    "waiting": ("vllm:num_requests_waiting", "prefixgate:num_requests_waiting",
                "sglang:num_queue_reqs", "llamacpp:requests_deferred"),
    "preemptions": ("vllm:num_preemptions", "prefixgate:num_preemptions"),
    "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries",
                       "prefixgate:prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits",
                    "prefixgate:prefix_cache_hits"),
    # histograms: _sum and _count are read
    "server_ttft": ("vllm:time_to_first_token_seconds", "prefixgate:time_to_first_token_seconds",
                    "sglang:time_to_first_token_seconds", "prefixgate_ttft_seconds"),
}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_MODEL_LABEL = re.compile(r'(?:^|,)\s*model(?:_name)?="((?:[^"\\]|\\.)*)"')


def parse(text: str | None, model: str | None = None) -> dict[str, float]:
    """Sample name -> value, summed over label sets; `_total` is dropped from counters.

    With `model`, a server that labels its samples by model (vLLM's and SGLang's
    `model_name`, a `model` label) counts only that model's samples (and the unlabelled
    ones); when no sample names `model` at all (an alias, say), every sample counts."""
    if model is not None:
        own = _parse(text, model)
        if own is not None:
            return own
    return _parse(text, None) or {}


def _parse(text: str | None, model: str | None) -> dict[str, float] | None:
    """parse()'s sums, counting only `model`'s samples when it is given (None: no sample
    is labelled with `model`)."""
    out: dict[str, float] = {}
    matched = model is None
    for line in (text or "").splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if model is not None and m.group(2):
            label = _MODEL_LABEL.search(m.group(2))
            if label is not None:
                if label.group(1) != model:
                    continue
                matched = True
        name = m.group(1)
        if name.endswith("_total"):
            name = name[:-6]
        if name.endswith("_created"):
            continue
        out[name] = out.get(name, 0.0) + value
    return out if matched else None


def get(values: dict[str, float], what: str) -> tuple[str, float] | None:
    """(metric name, value) of the first alias of `what` present."""
    for name in ALIASES[what]:
        if name in values:
            return name, values[name]
    return None


def histogram(values: dict[str, float], what: str) -> tuple[str, float, float] | None:
    """(name, sum, count) of the first histogram alias of `what` present."""
    for name in ALIASES[what]:
        if name + "_count" in values:
            return name, values.get(name + "_sum", 0.0), values[name + "_count"]
    return None


def delta(before: dict, after: dict, what: str) -> tuple[str, float] | None:
    a, b = get(after, what), get(before, what)
    if a is None:
        return None
    return a[0], a[1] - (b[1] if b and b[0] == a[0] else 0.0)


def mean_delta(before: dict, after: dict, what: str) -> float | None:
    """Mean of a histogram's observations made between two scrapes (None: none made)."""
    a, b = histogram(after, what), histogram(before, what)
    if a is None:
        return None
    s0, c0 = (b[1], b[2]) if b and b[0] == a[0] else (0.0, 0.0)
    n = a[2] - c0
    return (a[1] - s0) / n if n > 0 else None
