"""/metrics for `prefixgate serve --workers N`: a scrape reaches one worker, which answers for all.

Each worker serves its own registry's exposition on a unix socket of its own under the run's
folder (proxy/workers.py `Worker.metrics_socket`: connect, read to the end). The worker a
scrape lands on reads its siblings' concurrently, parses every exposition (its own too) with
prometheus_client's parser, labels each series with its worker (`worker="0"`, ...) and exposes
the union: counters, gauges, histograms and the collectors' own families alike, each family
once. A sibling that does not answer within SIBLING_TIMEOUT_S (restarting, stuck) is left out
of that answer, logged and counted in `prefixgate_metrics_siblings_skipped_total{sibling}`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from prometheus_client import Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("prefixgate.workers")

SIBLING_TIMEOUT_S = 1.0        # Prometheus' own scrape timeout is 10 s by default


class Siblings:
    """One worker's side of it: its socket, and the aggregated exposition it answers with."""

    def __init__(self, gw, worker):
        self.gw, self.worker = gw, worker
        self.skipped = Counter("prefixgate_metrics_siblings_skipped", "Workers left out of a "
                               "/metrics answer (no answer within "
                               f"{SIBLING_TIMEOUT_S:g} s)", ["sibling"], registry=gw.registry)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        path = self.worker.metrics_socket(self.worker.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)                  # the socket of this worker's previous process
        self._server = await asyncio.start_unix_server(self._answer, path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader, writer) -> None:
        try:
            writer.write(generate_latest(self.gw.registry))
            await writer.drain()
        except ConnectionError:
            pass                            # the asking sibling gave up
        finally:
            writer.close()

    async def exposition(self) -> bytes:
        """Every worker's series (this one's and the siblings' that answer), labelled."""
        own = (self.worker.index, generate_latest(self.gw.registry).decode())
        siblings = self.worker.siblings
        texts = await asyncio.gather(*(self._read(i) for i in siblings))
        return labelled([own, *((i, t) for i, t in zip(siblings, texts) if t is not None)])

    async def _read(self, index: int) -> str | None:
        try:
            async with asyncio.timeout(SIBLING_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(
                    self.worker.metrics_socket(index))
                try:
                    return (await reader.read()).decode()
                finally:
                    writer.close()
        except (OSError, asyncio.TimeoutError) as e:
            self.skipped.labels(str(index)).inc()
            log.warning("worker %d left out of /metrics: no answer within %gs (%s)", index,
                        SIBLING_TIMEOUT_S, e or type(e).__name__)
            return None


def labelled(expositions: list[tuple[int, str]]) -> bytes:
    """One exposition of several workers' ((index, Prometheus text)): each family once (in
    first-seen order), each sample with its worker's label. A family whose type differs from
    the first worker's that had it is left out."""
    families: dict[str, Metric] = {}
    for index, text in expositions:
        worker = str(index)
        for family in text_string_to_metric_families(text):
            into = families.get(family.name)
            if into is None:
                into = families[family.name] = Metric(family.name, family.documentation,
                                                      family.type, family.unit)
            elif into.type != family.type:
                continue
            into.samples += [s._replace(labels={**s.labels, "worker": worker})
                             for s in family.samples]
    return generate_latest(_Families(list(families.values())))


class _Families:
    """Parsed families, as generate_latest() takes a registry: something to collect()."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
