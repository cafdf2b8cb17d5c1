"""`python -m prefixgate.proxy.bench.overhead` end to end, small: the stand-in, the gateways
(with `--limits`: an API key, a limit counted in the replica and one counted in a real
redis-server; with `--workers 2 --observe`: each as two worker processes, plain, logging,
tracing and both) each answer every request, and the table reports each against its
baseline."""
from __future__ import annotations

import shutil

from prefixgate.proxy.bench import overhead


def test_the_overhead_bench_measures_every_gateway(capsys, tmp_path):
    out = tmp_path / "overhead.json"
    assert overhead.main(["--no-nginx", "--concurrency", "1", "--requests", "20", "--warmup",
                          "3", "--rounds", "1", "--limits", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    rows = {line.split("|")[2].strip(): line.split("|") for line in table.splitlines()
            if line.startswith("| 1 |")}
    expected = {"direct", "gateway", "gateway+key", "gateway+limit"}
    if shutil.which("redis-server"):
        expected.add("gateway+redis")
    assert set(rows) == expected, table
    assert rows["gateway+limit"][8].strip() != "–" and rows["gateway+key"][8].strip() == "–"
    assert out.read_text().count('"p50_ms"') == len(expected)


def test_with_workers_and_observe_every_gateway_answers(capsys):
    assert overhead.main(["--no-nginx", "--workers", "2", "--observe", "--concurrency", "1",
                          "--requests", "20", "--warmup", "3", "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    rows = {line.split("|")[2].strip() for line in table.splitlines() if line.startswith("| 1 |")}
    assert rows == {"direct", "gateway", "gateway+log", "gateway+trace", "gateway+both"}, table
