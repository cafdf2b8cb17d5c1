"""One backend server and its keep-alive connection pool; the `upstreams:` keys."""
from __future__ import annotations

import re
from collections.abc import Callable

import aiohttp

from prefixgate.common.schema import ConfigError, Key, check, one_of, positive
from prefixgate.proxy.upstream.h1pool import Pool

TIMEOUTS = {
    "connect": Key((int, float), 5.0, positive),
    "first_byte": Key((int, float), 120.0, positive),   # long prompts queue; vLLM can take a while
    "idle": Key((int, float), 60.0, positive),          # longest gap between two streamed chunks
}

_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.%\w]+\]|[^:/\[\]\s]+):(\d+)")


def tcp_endpoint(endpoint: str, host: str | None = None) -> str | None:
    """Why `endpoint` is not `tcp://HOST:PORT` (with `host`: that very host), else None."""
    m = _TCP.fullmatch(endpoint)
    want = f"tcp://{host or 'host'}:port"
    if m is None or not 0 < int(m.group(2)) < 65536:
        return f"must be {want} (got {endpoint!r})"
    if host is not None and m.group(1) != host:
        return f"must be {want}: the host is each discovered address (got {endpoint!r})"
    if host is None and m.group(1) == "*":
        return (f"must be {want}: the engine's address to connect to, not the * it binds "
                f"(got {endpoint!r})")
    return None


# The engine's KV event publisher (vLLM's --kv-events-config; prefix_route `index: kv_events`,
# plugins/prefix_route/kv_subscriber.py). The replay socket is required: it is how the
# gateway catches up at start, fills gaps and learns that the publisher is alive.
KV_EVENTS = {
    "endpoint": Key(str, check=tcp_endpoint),          # its PUB socket: tcp://host:5557
    "replay_endpoint": Key(str, check=tcp_endpoint),   # its ROUTER socket: tcp://host:5558
    "topic": Key(str, ""),                             # "": every topic
}

UPSTREAM = {
    "name": Key(str, None),
    "url": Key(str),
    "max_inflight": Key(int, 256, positive),      # gateway-side cap, also the load denominator
    "max_connections": Key(int, 256, positive),   # keep-alive pool size
    "weight": Key((int, float), 1.0, positive),
    "timeouts": Key(dict, dict, nested=TIMEOUTS),
    "headers": Key(dict, dict),                   # extra headers sent upstream (e.g. auth)
    # "tokens": chats that `prerender` tokenized go to /v1/completions as token ids
    # (backends that accept them: the bundled engine, vLLM); the answer comes back as chat
    "forward": Key(str, "json", one_of("json", "tokens")),
    # the model ids it serves; default: whatever its GET /v1/models lists (refreshed with
    # the health probes). Given here, the list wins (a backend without /v1/models).
    "models": Key(list, None),
    # prefill/decode disaggregation (`pd:`, proxy/pd.py): "prefill" takes only the prefill
    # legs of P/D requests; "decode" the decode legs and plain requests; "both" everything
    # but prefill legs (a server that is not split, the default)
    "role": Key(str, "both", one_of("prefill", "decode", "both")),
    # SGLang: the prefill server's --disaggregation-bootstrap-port, sent to both legs as
    # `bootstrap_port` (null: SGLang's default port)
    "bootstrap_port": Key((int, type(None)), None,
                          lambda p: None if 0 < p < 65536 else "must be 1..65535"),
    "kv_events": Key(dict, None, nested=KV_EVENTS),
}


def _check_url(url: str) -> str | None:
    if not (url.startswith("http://") or url.startswith("https://")):
        return "must start with http:// or https://"
    return None


def check_upstreams(raw: list, defaults: dict) -> list[dict]:
    ups, names = [], set()
    for i, item in enumerate(raw):
        path = f"upstreams[{i}]"
        up = check(item, UPSTREAM, path)
        reason = _check_url(up["url"])
        if reason:
            raise ConfigError(f"{path}.url", reason)
        up["url"] = up["url"].rstrip("/")
        up["name"] = up["name"] or up["url"].split("://", 1)[1]
        if up["name"] in names:
            raise ConfigError(f"{path}.name", f"duplicate upstream name {up['name']!r}")
        names.add(up["name"])
        up["timeouts"] = {**defaults, **{k: v for k, v in (item.get("timeouts") or {}).items()}}
        if up["models"] is not None and not all(isinstance(m, str) and m for m in up["models"]):
            raise ConfigError(f"{path}.models", "must be a list of model ids (strings)")
        ups.append(up)
    return ups


class Upstream:
    """A configured backend: its connection pools, in-flight count and health.

    Completions go through `pool` (proxy.h1pool: keep-alive, TCP_NODELAY, bytes passed
    through undecoded); the small control-plane requests (health polls, /v1/models,
    /metrics scrapes) use an aiohttp `session` that never decompresses either.
    """

    def __init__(self, cfg: dict, on_connect: list | None = None):
        self.cfg = cfg
        self.name: str = cfg["name"]
        self.url: str = cfg["url"]
        self.max_inflight: int = cfg["max_inflight"]
        self.role: str = cfg["role"]        # prefill | decode | both (route.py filters on it)
        self.timeouts: dict = cfg["timeouts"]
        self.extra_headers: dict = {str(k): str(v) for k, v in cfg["headers"].items()}
        self.inflight = 0                   # requests being exchanged with it now
        self.waiting = 0                    # requests routed to it, queued for a slot
        # the backend's own counts, when a plugin scrapes them (prefix_route's
        # poll_metrics_s): an object with requests(up) and kv_usage(up); None: not scraped
        self.polled = None
        self.healthy = True
        # model cards ({"id", ...}) as its /v1/models lists them, and the ids it serves
        # (None while unknown: it is then offered every model)
        self.model_cards: list[dict] | None = None
        self.models: frozenset[str] | None = None
        self.set_model_cards(None)
        self.connections_opened = 0
        # called with (upstream, seconds) for each new connection; shared gateway-wide
        self.on_connect: list[Callable[[Upstream, float], None]] = (
            on_connect if on_connect is not None else [])
        self.session: aiohttp.ClientSession | None = None   # control plane: polls, /v1/models
        self.pool: Pool | None = None                         # data plane: completions
        # request headers the gateway sets itself, so the client's copies are dropped
        self.replaced_headers = frozenset(
            {"accept-encoding", "x-request-id", "content-type"} | {k.lower() for k in
                                                                    self.extra_headers})

    def set_model_cards(self, cards: list[dict] | None) -> None:
        """What its /v1/models listed (None: not known). A static `models:` list wins."""
        self.model_cards = cards
        static = self.cfg["models"]
        self.models = (frozenset(static) if static is not None else
                       None if cards is None else frozenset(c["id"] for c in cards))

    @property
    def load(self) -> float:
        """Its load, the one every scorer reads: the requests at the backend — this gateway's
        in flight, or, where a poller scrapes the backend, its own running + waiting counts
        (every gateway replica's requests) — plus those waiting here for a slot on it."""
        at_backend = self.inflight if self.polled is None else self.polled.requests(self)
        return at_backend + self.waiting

    @property
    def kv_usage(self) -> float | None:
        """The backend's KV-cache usage (0..1) where a poller scrapes it, else None."""
        return None if self.polled is None else self.polled.kv_usage(self)

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def __repr__(self) -> str:
        return f"Upstream({self.name!r}, {self.url!r})"

    async def start(self) -> None:
        self.pool = Pool(self.url, self.cfg["max_connections"], self.timeouts["connect"],
                         self._connected)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=8),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts["connect"]),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.session is not None:
            await self.session.close()

    def _connected(self, seconds: float) -> None:
        self.connections_opened += 1
        for hook in self.on_connect:
            hook(self, seconds)
