"""The routing contract's shared pieces: one definition of upstream load that every scorer
reads, needs declared between plugins and checked when the chain is built, and admission's
room check as a declared hook."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError, Key
from prefixgate.plugins.balance import LeastInflight
from prefixgate.plugins.prefix_route.load_poll import LoadPoller, Sample
from prefixgate.proxy import route
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.chain import Chain
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.observe import usage
from prefixgate.proxy.plugin import Need, Plugin


def gateway(plugins: list, n: int = 2) -> Gateway:
    return Gateway(validate({"upstreams": [{"name": f"u{i}", "url": f"http://127.0.0.1:{9 + i}",
                                            "max_inflight": 8} for i in range(n)],
                             "plugins": plugins}))


def test_load_is_in_flight_plus_waiting():
    a = gateway([]).upstreams[0]
    a.inflight, a.waiting = 3, 2
    assert a.load == 5 and a.kv_usage is None


def test_polled_load_is_the_backends_counts_plus_waiting_here_until_stale():
    gw = gateway([])
    a = gw.upstreams[0]
    poller = LoadPoller(gw, 1.0)
    a.inflight, a.waiting = 3, 2
    # the backend ran 7 and queued 1 when 1 of ours was in flight: 2 more of ours since
    poller.samples["u0"] = Sample(7.0, 1.0, 0.4, 1, time.monotonic())
    a.polled = poller
    assert a.load == 7 + 1 + (3 - 1) + 2 and a.kv_usage == 0.4
    poller.samples["u0"].t -= 100            # stale: the gateway's own counts again
    assert a.load == 5 and a.kv_usage is None
    poller._answered_late(a)                 # a late answer does not bring it back
    assert a.load == 5
    poller.samples["u0"].t = time.monotonic() - poller.stale_after_s + 0.5   # fresh 0.5 s more
    poller._answered_late(a)                 # a poll answered too late: kept in use...
    poller.samples["u0"].t -= 100            # ...however old the sample itself
    assert a.load == 7 + 1 + (3 - 1) + 2 and a.kv_usage == 0.4


def test_every_load_reader_sees_the_same_load():
    gw = gateway([{"prefix_route": {"policy": "cache_aware"}}, "least_inflight"])
    for u, (inflight, waiting) in zip(gw.upstreams, [(3, 1), (1, 0)]):
        u.inflight, u.waiting = inflight, waiting
    loads = {u: u.load for u in gw.upstreams}
    assert route.LeastLoaded.score(None, gw.upstreams) == {u: -v for u, v in loads.items()}
    least_inflight = next(p for p in gw.chain.plugins if isinstance(p, LeastInflight))
    assert least_inflight.score(None, gw.upstreams) == {u: 1 - v / 8 for u, v in loads.items()}
    reported = {s.labels["upstream"]: s.value for m in gw.registry.collect()
                if m.name == "prefixgate_route_upstream_load" for s in m.samples}
    assert reported == {u.name: v for u, v in loads.items()}


class Tokenizes(Plugin):
    name = "tokenizes"
    provides = frozenset({"tokens"})


class WantsTokens(Plugin):
    name = "wants_tokens"
    needs = (Need("tokens", "keys", "needs token ids from another plugin"),)


@pytest.mark.parametrize("order, error", [
    (["tokenizes", "wants_tokens"], None),
    (["wants_tokens", "tokenizes"], None),      # every on_request runs before routing
    (["wants_tokens"], "plugins[0].{m}:WantsTokens.keys: needs token ids"),
])
def test_a_need_is_met_by_any_plugin_of_the_chain(order, error):
    names = {"tokenizes": f"{__name__}:Tokenizes", "wants_tokens": f"{__name__}:WantsTokens"}
    plugins = [names[n] for n in order]
    if error is None:
        assert [p.name for p in gateway(plugins).chain.plugins[:2]] == order
        return
    with pytest.raises(ConfigError) as e:
        gateway(plugins)
    assert str(e.value).startswith(error.format(m=__name__)), str(e.value)


class Odd:
    """A room check that keeps upstreams whose name ends in an odd digit."""
    def with_room(self, upstreams):
        return [u for u in upstreams if int(u.name[-1]) % 2]


class NotThree:
    def with_room(self, upstreams):
        return [u for u in upstreams if u.name != "u3"]


def test_room_is_the_chains_with_room_hooks_else_max_inflight():
    ups = gateway([], n=6).upstreams
    ups[0].inflight = ups[0].max_inflight
    assert route.with_room(Chain([]), ups) == ups[1:]
    chain = Chain([Odd(), NotThree()])
    assert chain.active == 0
    assert [u.name for u in route.with_room(chain, ups)] == ["u1", "u5"]


class ReadsUsage(Plugin):
    """Keeps what each stream's usage event said, as a plugin learning from answers does."""
    name = "reads_usage"
    spec = {"keep": Key(bool, True)}
    seen: list = []

    def __init__(self, cfg, gw):
        super().__init__(cfg, gw)
        self.keeps_stream_tail = self.cfg["keep"]

    def on_finish(self, ctx, error):
        self.seen.append((usage.from_stream(ctx.tail) or {}).get("usage") if ctx.tail else None)


@pytest.mark.parametrize("keep", [True, False])
async def test_a_plugin_that_asks_reads_a_streams_usage_at_its_end(make_standin, make_gateway,
                                                                    keep):
    standin = await make_standin(tokens=3)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": standin.url}],
                             "plugins": [{f"{__name__}:ReadsUsage": {"keep": keep}}]})
    ReadsUsage.seen = []
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json={
                "model": "standin-model", "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "hello there"}]}) as r:
            assert r.status == 200
            await r.read()
    await asyncio.sleep(0)
    if keep:
        [answer] = ReadsUsage.seen
        assert answer["completion_tokens"] == 3 and answer["prompt_tokens"] > 0, answer
    else:       # no access log, no tracing, no plugin asking: nothing kept on the hot path
        assert ReadsUsage.seen == [None]
