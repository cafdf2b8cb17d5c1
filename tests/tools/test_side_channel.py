"""`python -m prefixgate.proxy.bench.side_channel` end to end, small: a real bundled engine (the
demo model) behind a real gateway with two keys, in both isolation modes. Asserted are the
facts no timing noise can change, the engine's own cached_tokens: under `shared` tenant B's
probe of a document tenant A sent is served from A's cache, under `per_key` no probe ever is.
Timing (the classifier's accuracy) belongs to the benchmark, not to a test."""
from __future__ import annotations

import json

from prefixgate.proxy.bench import side_channel as sc


def test_the_side_channel_bench_shows_the_cache_to_b_under_shared_and_never_under_per_key(
        capsys, tmp_path):
    out = tmp_path / "side_channel.json"
    assert sc.main(["--trials", "8", "--warmup", "1", "--doc-tokens", "128", "--pause-ms", "10",
                    "--out", str(out)]) == 0
    table = capsys.readouterr().out
    archive = json.loads(out.read_text())
    assert archive["schema"] == sc.SCHEMA and archive["environment"]["python"]
    assert [m["mode"] for m in archive["modes"]] == ["shared", "per_key"]
    for mode in ("shared", "per_key"):
        assert any(line.startswith(mode) for line in table.splitlines()), table
    for m in archive["modes"]:
        assert m["errors"] == 0, m.get("first_error")
        measured = [t for t in m["trials"] if not t["warmup"]]
        assert len(measured) == 8 and len(m["trials"]) == 9
        assert m["sent"]["n"] == m["not_sent"]["n"] == 4      # each half balanced
        assert all(t["ttft_ms"] > 0 and t["prompt_tokens"] > 128 for t in m["trials"])
        c = m["classifier"]
        assert c["held_out_n"] == 8 and len(c["folds"]) == 2
        assert 0.0 <= c["held_out_accuracy"] <= 1.0 and 0.0 <= c["p_value"] <= 1.0
        assert m["prefill_classifier"]["held_out_n"] == 8     # the engine's Server-Timing
        for arm in ("sent", "not_sent"):
            assert set(m[arm]) >= {"ttft_p10_ms", "ttft_p50_ms", "ttft_p90_ms",
                                   "cached_tokens_p50"}
    shared, per_key = archive["modes"]
    # under shared, B's probe after A sent the document finds the whole document cached
    # (128 tokens: the template's head and the document, floored to 16-token blocks)
    for t in shared["trials"]:
        if t["sent"]:
            assert t["cached_tokens"] >= 112, t
        else:
            assert t["cached_tokens"] == 0, t
    # under per_key, A's blocks are salted with A's salt: nothing of them reaches B
    assert all(t["cached_tokens"] == 0 for t in per_key["trials"])
    assert per_key["sent"]["probes_with_cached_tokens"] == 0
    assert "target" in per_key and "target" not in shared
    # A's own requests are fresh documents: never cached either
    assert all(t["a_cached_tokens"] == 0 for m in archive["modes"] for t in m["trials"])


def test_labels_are_balanced_in_each_half_and_the_same_for_a_seed():
    for trials in (2, 7, 8, 200):
        got = sc.labels(trials, 3)
        assert got == sc.labels(trials, 3) and len(got) == trials
        for half in (0, 1):
            xs = got[half::2]
            assert abs(sum(xs) - (len(xs) - sum(xs))) <= 1
    assert sc.labels(200, 0) != sc.labels(200, 1)


def test_the_classifier_fits_a_threshold_and_its_direction():
    fast_sent = [(30.0, True), (31.0, True), (250.0, False), (260.0, False)]
    fit = sc.fit_threshold(fast_sent)
    assert fit["accuracy"] == 1.0 and fit["faster_is_sent"] and 31.0 < fit["threshold_ms"] < 250
    slow_sent = [(x, not s) for x, s in fast_sent]
    assert sc.fit_threshold(slow_sent)["faster_is_sent"] is False
    trials = [{"ttft_ms": x, "sent": s, "half": i % 2} for i, (x, s) in enumerate(
        fast_sent * 2)]
    c = sc.classify(trials)
    assert c["held_out_accuracy"] == 1.0 and c["best_threshold_accuracy"] == 1.0
    assert c["held_out_right"] == c["held_out_n"] == 8
    assert sc.binomial_p(8, 8) == 1 / 256 and sc.binomial_p(0, 8) == 1.0
