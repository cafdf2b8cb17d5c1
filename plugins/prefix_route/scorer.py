"""What prefix_route's scorers (one per `policy`) share.

Each scorer reads the request's prefix keys (`keys.py`) and the upstreams' load
(`Upstream.load`: in flight + waiting, or the backends' polled counts with `poll_metrics_s`);
an upstream whose polled KV-cache usage reaches `kv_saturation` is saturated and avoided. A
request without a key goes to the least loaded upstream (predicted_ttft: the one predicted
to answer first). Every decision is counted once in `prefixgate_route_decisions{policy,
outcome}` and told to the client in the `x-prefixgate-route` header (predicted_ttft adds its
predictions). The scorer also follows the upstream set (discovery, reloads): a policy's
state about upstreams is rebuilt when the set changes. A request that names its session or
its cache (`session:`, sessions.py: on by default, headers, `prompt_cache_key`,
`metadata.user_id`) goes to the session's upstream first.

Every policy scores every candidate (DESIGN.md §2), so that a `weight:` mixes it with a load
scorer: the policy's own choice gets the top score, and the gateway's pick among them alone
is the policy's choice, ties included; the other candidates rank below it by the policy's
own measure (its module doc says which). The scores shared here:

- the least-loaded fallback: 1 for the lightest candidates that are not saturated (a longer
  partial match first), else 1 / (1 + requests above the lightest), halved when saturated;
- a kept session: the policy's scores plus SESSION_BONUS on the session's upstream, more than
  any policy's whole range (0..1), so that it wins against a load scorer of equal weight
  wherever the one-hot score it replaces did.
"""
from __future__ import annotations

from prometheus_client import Counter

from prefixgate.plugins.prefix_route.keys import Keys, PrefixKeys
from prefixgate.plugins.prefix_route.sessions import Sessions, short_hash

BELOW_TOP = 1.0 - 1e-9      # a candidate's score where it would equal the policy's choice's
SATURATED = 0.5             # a saturated upstream's score is multiplied by this
SESSION_BONUS = 2.0         # added to the score of a kept session's upstream


class PrefixScorer:
    policy = ""             # its `policy:` value: a label of its decisions, the header's start

    def __init__(self, gw, keys: PrefixKeys, cfg: dict):
        self.gw = gw
        self.keys = keys
        self.kv_saturation = cfg["kv_saturation"]
        self.abs_threshold = cfg["balance_abs_threshold"]
        self.rel_threshold = cfg["balance_rel_threshold"]
        session = cfg["session"]
        self.sessions = Sessions(session) if session and session["mode"] != "off" else None
        self.decisions = Counter("prefixgate_route_decisions", "Routing decisions by policy and "
                                 "outcome (chwbl: home, spill, nokey; cache_aware: cache, new, "
                                 "balance, nokey; predicted_ttft: home, spill, new, nokey; "
                                 "any policy: session)", ["policy", "outcome"],
                                 registry=gw.registry)
        self.session_routes = Counter("prefixgate_route_sessions", "Requests that named a "
                                      "session: kept on the session's upstream, moved off "
                                      "it (soft mode: saturated or overloaded), or placed "
                                      "(predicted_ttft over KV events: a new session)",
                                      ["outcome"],
                                      registry=gw.registry) if self.sessions else None
        self._outcomes: dict[str, object] = {}     # outcome -> its counter child, bound once
        self._members = None          # the gw.upstreams list the policy's state was built from

    def score(self, ctx, upstreams) -> dict:
        members = self.gw.upstreams
        if members is not self._members:
            self._members = members
            self.members_changed(members)
        keys = self.keys.of(ctx)
        found = self.sessions.session_key(ctx) if self.sessions is not None else None
        if found is not None:
            source, session = found
            ctx.route_info["session_key"] = f"{source}:{short_hash(session)}"
            scores = self.for_session(ctx, keys, self.sessions.upstream(session, upstreams),
                                      upstreams, session)
        else:
            scores = self.by_policy(ctx, keys, upstreams)
        self.report(ctx)
        return scores

    def by_policy(self, ctx, keys: Keys, upstreams) -> dict:
        if not keys.chain and keys.short is None:
            return self.no_key(ctx, upstreams)
        return self.choose(ctx, keys, upstreams)

    def for_session(self, ctx, keys: Keys, home, upstreams, session: bytes = b"") -> dict:
        """A request of a session (key `session`): to `home`, its upstream, unless (soft
        mode) home is saturated or overloaded; then the policy routes it."""
        if self.sessions.hard or not (self.saturated(home) or self.overloaded(
                home.load, min(u.load for u in upstreams))):
            return self.session_kept(ctx, home, self.by_policy(ctx, keys, upstreams))
        self.session_moved(ctx)
        return self.by_policy(ctx, keys, upstreams)

    def session_kept(self, ctx, home, scores: dict) -> dict:
        """The policy's `scores`, with the session's bonus on `home`."""
        ctx.route_info["session"] = "kept"
        self.session_routes.labels("kept").inc()
        self.decided(ctx, "session")
        scores[home] = scores.get(home, 0.0) + SESSION_BONUS
        return scores

    def session_moved(self, ctx) -> None:
        ctx.route_info["session"] = "moved"
        self.session_routes.labels("moved").inc()

    def no_key(self, ctx, upstreams) -> dict:
        """The scores for a request without a key (default: the least loaded upstream)."""
        return self.least_loaded(ctx, upstreams, "nokey")

    def choose(self, ctx, keys: Keys, upstreams) -> dict:
        """The policy's scores for a request that has a key."""
        raise NotImplementedError

    def members_changed(self, upstreams) -> None:
        """Rebuild what the policy keeps per upstream for this upstream set."""
        raise NotImplementedError

    def overloaded(self, load: float, lightest: float) -> bool:
        """More than balance_abs_threshold requests above the lightest, and more than
        balance_rel_threshold times it (cache_aware's test, and soft sessions')."""
        return load - lightest > self.abs_threshold and load > lightest * self.rel_threshold

    def saturated(self, up) -> bool:
        kv = up.kv_usage
        return kv is not None and kv >= self.kv_saturation

    def least_loaded(self, ctx, upstreams, outcome: str, loads: dict | None = None,
                     matched: dict | None = None) -> dict:
        """The least loaded upstreams (not saturated) score 1, among them those with the
        longest partial match; every other one 1 / (1 + its requests above the lightest),
        below 1, halved when saturated."""
        loads = loads or {u: u.load for u in upstreams}
        saturated = {u for u in upstreams if u.polled is not None and self.saturated(u)}
        if len(saturated) == len(upstreams):
            saturated = ()              # all of them: none is worse for it
        lightest = min(loads[u] for u in upstreams if u not in saturated) if saturated else \
            min(loads.values())
        ctx.route_info.setdefault("policy", self.policy)
        self.decided(ctx, outcome)
        scores = {u: 1.0 / (1.0 + load - lightest) if load > lightest else 1.0
                  for u, load in loads.items()}
        for u in saturated:
            scores[u] *= SATURATED
        if matched:       # a partial match breaks the tie between the lightest upstreams
            top = [u for u in upstreams if loads[u] == lightest and u not in saturated]
            most = max(matched.get(u.name, 0) for u in top)
            for u in top:
                if matched.get(u.name, 0) < most:
                    scores[u] = BELOW_TOP
        return scores

    def decided(self, ctx, outcome: str) -> None:
        """The decision's outcome (counted, and told in the header, by `report`)."""
        ctx.route_info["outcome"] = outcome

    def report(self, ctx) -> None:
        """Count the decision and tell the client why (the route header)."""
        info = ctx.route_info
        outcome = info["outcome"]
        counter = self._outcomes.get(outcome)
        if counter is None:
            counter = self._outcomes[outcome] = self.decisions.labels(self.policy, outcome)
        counter.inc()
        header = f"{self.policy}; outcome={outcome}; blocks={info.get('blocks', 0)}"
        if "key" in info:
            header += f"; key={info['key']}; home={info['home']}"
        if "best_match" in info:
            header += f"; matched={info['best_match']}"
        if "predicted_ttft_ms" in info:     # the chosen upstream's, then the runner-up's
            header += f"; predicted_ttft_ms={info['predicted_ttft_ms']}"
        if "session" in info:
            header += f"; session={info['session']}; session_key={info['session_key']}"
        ctx.response_headers["x-prefixgate-route"] = header
