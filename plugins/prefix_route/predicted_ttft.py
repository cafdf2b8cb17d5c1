"""`policy: predicted_ttft` — send a request where its first token is predicted to come first.

For each candidate upstream u (requests' times in seconds, sizes in prompt tokens):

    predicted(u) = overhead(u) + (ahead(u) + own(u)) / rate(u)

- own(u): this request's prompt tokens u does not hold: the prompt less the index's match for
  u (`index:` approximate, or the engines' KV events);
- ahead(u): the uncached tokens already routed to u and not yet answered (prefill_queue.py),
  plus as much as the oldest of them has waited past its time (work this replica does not
  see), plus, where the backends' metrics are polled, the requests u says wait beyond those;
- rate(u), overhead(u): u's fit for the request's model (ttft_model.py), learned from u's
  own answers, anchored to the fleet's line while they are few, so mixed hardware needs no
  configuration: a backend half as fast is predicted twice as slow and gets about half the
  uncached work.

The candidates are the upstreams predicted within `tie_ms`, or `tie_fraction` of the best,
whichever is larger; of them, those holding the most of the prompt (the cache home, while it
is within the tie), else all; among those, rendezvous hashing of the prompt's first
`prefix_blocks` blocks and its model (`_place`) picks one, so that gateway replicas sharing
nothing place a prefix new to them alike: affinity holds until the home is saturated, and a
spill goes where every replica spills it. Where the home holds less than half of the prompt
(LIVES_SHARE: a head many prompts share, such as a RAG prompt before its document), the
first block past what it holds is hashed among all within the tie instead: each replica
knows the shared head on the upstreams it sent it to, which differ from replica to replica,
while the prompt's own part hashes alike everywhere (as SGLang's and this project's
`cache_aware` stop following a match below their `cache_threshold`). For a prompt no
upstream holds any of, the tie narrows as such prompts become the rule (`_reused`): where
prompts are never seen again, placing them alike buys nothing, and the fastest upstream
spreads them more evenly than their hashes do. The prefill leg of a P/D request is chosen
the same way among the prefill upstreams (the chain's scorers pick it, proxy/pd.py), by
predicted prefill time.

Score (every candidate, so that a `weight:` mixes it with a load scorer): the chosen upstream
1, every other the ratio of the chosen one's effective prediction to its own, below 1 — an
upstream predicted twice as slow as the chosen one scores 0.5. A prediction is effective as
it is, but for a choice made within the tie (a home kept, a prefix placed): predicted × best /
(best + tie), the tie's additive allowance as a factor at this decision, so the choice is the
top score exactly when it is kept; a saturated upstream's score is halved; no other scores 1.
Where another scorer's weight or a session's bonus makes the gateway pick another upstream,
the request's prefill work moves to that upstream's lane before the next decision (`_settle`).

Outcomes: `home` (an upstream holding the most of the prompt took it), `spill` (the home was
slower than the tie, or held only a shared head: one holding less, or none, took it), `new`
(no upstream holds a block of it), `nokey` (no key: no upstream holds any of it), `session`
(soft `session:` mode: the session's upstream is the home, and kept it).
The route header adds `predicted_ttft_ms=` for the chosen upstream and the runner-up.

Learning, when the request ends: the time measured is the upstream's TTFT as the gateway saw
it (request written to first event; streams only, a whole answer's head comes after its last
token) or a P/D request's prefill leg; the tokens are `usage`'s prompt − cached tokens when
the answer has them, else the prediction's own estimate. The line fitted is the predictor's
own: the whole time against ahead + own tokens. (Taking the engine's `queue` entry of
Server-Timing out of the time and fitting the own tokens alone lost the rate wherever prompts
have one length: every point then sits at one token count, and a slower engine's time went
into the overhead, which the queue ahead is not multiplied by.)
Requests that were retried, or went elsewhere than this scorer chose, teach nothing.
`prefixgate_route_ttft_prediction_error{upstream}` is |predicted − measured| / measured.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from prometheus_client import Histogram

from prefixgate.plugins.prefix_keys import prompt_token_ids
from prefixgate.plugins.prefix_route.hash_ring import Rendezvous
from prefixgate.plugins.prefix_route.indexes import MAX_MODELS, EngineIndex
from prefixgate.plugins.prefix_route.keys import Keys, PrefixKeys, ring_position
from prefixgate.plugins.prefix_route.prefill_queue import PrefillQueue
from prefixgate.plugins.prefix_route.scorer import (
    BELOW_TOP,
    SATURATED,
    SESSION_BONUS,
    PrefixScorer,
)
from prefixgate.plugins.prefix_route.ttft_model import DEFAULT_PRIOR, Prior, TTFTModel
from prefixgate.proxy.observe import usage

STATE_KEY = "predicted_ttft"        # the request's Routed (ctx.state)
BYTES_PER_TOKEN = 4                 # a text-keyed prompt's size, without its token ids
# a session lives on the upstream holding at least this share of its prompt's blocks: every
# turn repeats the conversation, so its history is most of the prompt, while an upstream that
# holds only a head many prompts share (the template's, a common preamble) is not its home
LIVES_SHARE = 0.5
MASK64 = (1 << 64) - 1
# A prompt no upstream holds any of is placed by the hash within the tie scaled by the share
# of recent keyed prompts that some upstream held a block of (an average over about
# REUSE_WINDOW): the whole tie from REUSE_WHOLE_TIE up (tenants' prompts: 84-98% held in the
# fleet simulator with 1 to 16 replicas), none at 0 (unique prompts: the fastest upstream)
REUSE_WINDOW = 8
REUSE_WHOLE_TIE = 0.5
NOTHING_HELD: dict[str, int] = {}   # the match of a prompt no upstream holds any of
ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)


@dataclass(slots=True)
class Routed:
    """Where a request was sent and what was predicted for it there."""
    name: str               # the upstream chosen
    key: int                # its entry in that upstream's lane (0: off the lane)
    cached: float           # prompt tokens the upstream was thought to hold
    own: float              # ... and to compute
    ahead: float            # tokens ahead of it there
    predicted_s: float
    retried: bool = False   # routed more than once (a failed attempt before): teaches nothing
    moved: bool = False     # another scorer sent it elsewhere (on that lane): teaches nothing
    answered: bool = False  # its first byte came


class PredictedTTFT(PrefixScorer):
    policy = "predicted_ttft"

    def __init__(self, gw, keys: PrefixKeys, cfg: dict, index):
        super().__init__(gw, keys, cfg)
        self.index = index           # match(ctx, keys, upstreams) -> {name: leading blocks}
        self.exact = isinstance(index, EngineIndex)   # the engines' KV events: one view
        rate, overhead = cfg["prior_tokens_per_second"], cfg["prior_overhead_ms"]
        prior = None if rate is None and overhead is None else Prior(
            rate or DEFAULT_PRIOR.tokens_per_s,
            DEFAULT_PRIOR.overhead_s if overhead is None else overhead / 1e3)
        self.model = TTFTModel(prior, cfg["fit_half_life_s"])
        self.queue = PrefillQueue()
        self.rendezvous = Rendezvous()
        self._slots: dict[str | None, dict[str, tuple]] = {}   # model -> name -> (fit, lane)
        self.tie_s = cfg["tie_ms"] / 1e3
        self.tie_fraction = cfg["tie_fraction"]
        self.block_tokens = cfg["block_tokens"]
        self.text_block_tokens = cfg["block_bytes"] / BYTES_PER_TOKEN
        self.clock = time.monotonic          # the fleet simulator sets its simulated clock
        self._unsettled = None               # the last decision until its pick is known
        # model -> of its recent keyed prompts, the share held somewhere (from 1)
        self.reuse: dict[str | None, float] = {}
        self.errors = Histogram("prefixgate_route_ttft_prediction_error", "predicted_ttft: "
                                "|predicted - measured| / measured time to first token, per "
                                "upstream", ["upstream"], buckets=ERROR_BUCKETS,
                                registry=gw.registry)

    def members_changed(self, upstreams) -> None:
        self.index.retain(upstreams)
        names = {u.name for u in upstreams}
        self.model.retain(names)
        self.queue.retain(names)
        self._slots.clear()

    # --- the decision ----------------------------------------------------------------------
    def choose(self, ctx, keys: Keys, upstreams, session=None, placing: bytes = b"") -> dict:
        matched = keys.matched = self.index.match(ctx, keys, upstreams) if keys.chain else {}
        per_block = self.block_tokens if keys.mode == "tokens" else self.text_block_tokens
        ctx.route_info.update(policy=self.policy, blocks=len(keys.chain), mode=keys.mode)
        return self._route(ctx, upstreams, matched, per_block,
                           self._prompt_tokens(ctx, keys, per_block), session,
                           placing=placing, place_key=self.keys.route_key(keys),
                           chain=keys.chain)

    def no_key(self, ctx, upstreams, session=None) -> dict:
        ctx.route_info.update(policy=self.policy, blocks=0)
        tokens = len(ctx.tokens) if ctx.tokens is not None else len(ctx.raw_body) / BYTES_PER_TOKEN
        return self._route(ctx, upstreams, {}, 0, max(tokens, 1), session)

    def for_session(self, ctx, keys: Keys, home, upstreams, session: bytes = b"") -> dict:
        """Soft mode. Over the engines' KV events (an index every replica reads alike) a
        session lives where its history is — the one upstream that holds more of its prompt
        than any other — and stays there until saturated or overloaded (the soft rule); a
        session that lives nowhere yet is placed by rendezvous hashing among the upstreams
        predicted within the tie of the fastest: replicas agree, and a busy upstream takes no
        new session. A hash of the key alone would put few long sessions unevenly (six of
        eight on one of two engines) and a prediction alone would move a session off its
        history for one turn's queue. Over the approximate index (each replica its own view)
        the session's hashed upstream is its home, kept within the tie. (Its history: at
        least LIVES_SHARE of the prompt's blocks.)"""
        if self.sessions.hard:
            return super().for_session(ctx, keys, home, upstreams, session)
        if not keys.chain and keys.short is None:
            return self.no_key(ctx, upstreams, home)
        if self.exact and session and keys.mode == "tokens":
            keys.matched = self.index.match(ctx, keys, upstreams)
            lives = sole_longest(keys.matched, upstreams, len(keys.chain) * LIVES_SHARE)
            if lives is not None:
                return super().for_session(ctx, keys, lives, upstreams, session)
            return self.choose(ctx, keys, upstreams, placing=session)
        return self.choose(ctx, keys, upstreams, home)

    def _route(self, ctx, upstreams, matched: dict, per_block: float, prompt: float,
               session=None, avoid_full: bool = True, placing: bytes = b"",
               place_key: int | None = None, chain: list[int] | None = None) -> dict:
        """The decision (module doc); `place_key`: the prompt's route key (keys.py), which
        `_place` hashes where the choice is made within the tie; `chain`: the prompt's block
        hashes (keyed prompts)."""
        self._settle()
        now = self.clock()
        model = ctx.model
        slots = self._slots.get(model) or self._slots.setdefault(model, {})
        slot_of = slots.get
        held = (matched or NOTHING_HELD).get
        draw = random.random
        best = second = home = None   # rows: (predicted s, upstream, ahead, cached, matched)
        best_t = second_t = home_t = math.inf
        home_m = home_n = ties = 0    # home_n: candidates holding home_m blocks (no session)
        rows, full = [], None         # every candidate's row; the saturated ones'
        add = rows.append
        for u in upstreams:
            polled = u.polled
            name = u.name
            fit, lane = slot_of(name) or self._slot(slots, name, model, now)
            per_token = fit.per_token_s
            m = held(name, 0)
            cached = min(m * per_block, prompt - 1) if m else 0
            if polled is not None:
                ahead = lane.ahead(now, per_token, polled.waiting(u))
            else:
                ahead = lane.ahead(now, per_token) if lane.tokens else 0.0
            t = fit.overhead_s + per_token * (ahead + prompt - cached)
            row = (t, u, ahead, cached, m)
            if polled is not None and avoid_full and self.saturated(u):
                full = [row] if full is None else full + [row]
                continue
            add(row)
            if t < best_t:
                second, second_t, best, best_t = best, best_t, row, t
                ties = 1
            elif t == best_t:                 # equals (idle twins): one of them at random
                ties += 1
                if draw() * ties < 1:
                    second, best = best, row
                else:
                    second = row
                second_t = t
            elif t < second_t:
                second, second_t = row, t
            if session is not None:
                if u is session:
                    home, home_m, home_t = row, m, t
            elif m:
                if m > home_m:
                    home, home_m, home_t, home_n = row, m, t, 1
                elif m == home_m:
                    home_n += 1
                    if t < home_t:
                        home, home_t = row, t
        if best is None:                  # every one saturated: the least bad of them
            return self._route(ctx, [row[1] for row in full], matched, per_block, prompt,
                               session, False, placing, place_key, chain)
        allowance = max(self.tie_s, self.tie_fraction * best_t)
        limit = best_t + allowance        # within the tie: predicted at most this
        if placing:                       # a new session: hashed among the near-fastest
            near = [row for row in rows if row[0] <= limit]
            pick = self.sessions.upstream(placing, [row[1] for row in near])
            chosen = home = next(row for row in near if row[1] is pick)
            outcome = "session"
            ctx.route_info["session"] = "placed"
            self.session_routes.labels("placed").inc()
        elif session is not None and home_t <= limit:
            chosen, outcome = home, "home"
        else:
            reused = (self._reused(model, home_m > 0)
                      if place_key is not None and session is None else 1.0)
            if place_key is None:
                chosen = best
            elif not home_m and session is None:
                # a prompt no upstream holds: the tie as wide as prompts are seen again
                allowance *= min(reused / REUSE_WHOLE_TIE, 1.0)
                chosen = self._place(place_key, model, [row for row in rows
                                                        if row[0] <= best_t + allowance])
            elif session is None and home_m < len(chain) * LIVES_SHARE:
                # the most any upstream holds is a head many prompts share (a RAG prompt
                # before its document, a system prompt before a long history): the prompt's
                # own part is new, placed by its first block among all within the tie, as
                # every replica places it, whichever upstreams its own view says hold the head
                chosen = self._place(chain[home_m], model,
                                     [row for row in rows if row[0] <= limit])
            elif session is None and home_t <= limit:
                # the home is within the tie, so the most any candidate holds is home_m:
                # alone with it, it is the choice; else those holding as much are hashed
                chosen = home if home_n == 1 else self._place(
                    place_key, model, [row for row in rows
                                       if row[4] == home_m and row[0] <= limit])
            else:           # a spill: the home (or the session's upstream) beyond the tie
                chosen = self._place(place_key, model, _most(
                    [row for row in rows if row[0] <= limit]))
            if not home_m:
                outcome = "new" if ctx.route_info["blocks"] else "nokey"
            elif chosen[4] == home_m:
                home, outcome = chosen, "home"
            else:
                outcome = "spill"
        if session is not None:
            if chosen[1] is session:
                ctx.route_info["session"] = "kept"
                self.session_routes.labels("kept").inc()
                outcome = "session"
            else:
                self.session_moved(ctx)
        self._routed(ctx, chosen, prompt, now, rows if full is None else rows + full)
        ctx.route_info.update(best_match=home_m, predicted_ttft_ms=_header_times(
            chosen, second if chosen[1] is best[1] else best))
        self.decided(ctx, outcome)
        scores = self._scores(rows, full, chosen, best_t, allowance,
                              kept=bool(placing) or place_key is not None or session is not None)
        if outcome == "session":
            scores[chosen[1]] += SESSION_BONUS
        return scores

    def _reused(self, model: str | None, held: bool) -> float:
        """Count a keyed prompt for `model` that some upstream held a block of (`held`), or
        none did; the share of the model's recent ones that were held (per model: one
        model's traffic may be unique prompts, another's tenants). A prefix placed alike by
        every replica pays only if it comes again: where prompts are unique (vLLM's `random`
        dataset, one-off documents) the hash would spread them at random, less evenly than
        the fastest upstream does, and the tie shrinks toward it."""
        reuse = self.reuse
        share = reuse.get(model)
        if share is None:
            if len(reuse) >= MAX_MODELS:      # models named by clients: bounded
                reuse.clear()
            share = 1.0
        share = reuse[model] = share + ((1.0 if held else 0.0) - share) / REUSE_WINDOW
        return share

    def _place(self, key: int, model: str | None, rows: list) -> tuple:
        """The row among `rows` (those within the tie that hold the most leading blocks of
        the prompt: all, where none holds one) that every replica picks for route key `key`:
        the one rendezvous hashing of the key and the model ranks first. Unweighted: the
        load and the speed decide which upstreams are in the tie, not the order within it.
        Weighted by the prediction (1 / predicted seconds, as before 2026-12-07), each
        replica's own view of the work ahead moved keys from one upstream to the other
        between replicas (docs/routing.md, "The placement unweighted"); weighted by the fitted
        speed, fits that each replica learns a little differently did the same in the fleet
        simulator."""
        if len(rows) == 1:
            return rows[0]
        pick = self.rendezvous.pick((ring_position(key, model) & MASK64).to_bytes(8, "little"),
                                    [row[1] for row in rows])
        return next(row for row in rows if row[1] is pick)

    @staticmethod
    def _scores(rows: list, full: list | None, chosen: tuple, best_t: float,
                allowance: float, kept: bool) -> dict:
        """Every candidate's score (module doc): the chosen one 1, the others their
        prediction's ratio to the chosen one's effective prediction, below 1 (halved when
        saturated); `kept`: chosen within the tie (placed, or its home), not as the fastest."""
        t = chosen[0]
        ref = t * best_t / (best_t + allowance) if kept else best_t
        # min(ref / t, BELOW_TOP), without a call per candidate
        scores = {row[1]: BELOW_TOP if BELOW_TOP < (r := ref / row[0]) else r for row in rows}
        if full is not None:
            for row in full:
                scores[row[1]] = min(ref / row[0], BELOW_TOP) * SATURATED
        scores[chosen[1]] = 1.0
        return scores

    def _slot(self, slots: dict, name: str, model: str | None, now: float) -> tuple:
        """(fit, lane) of upstream `name` for `model`, looked up once per candidate."""
        slot = slots[name] = (self.model.fit(name, model, now), self.queue.lane(name))
        return slot

    def _prompt_tokens(self, ctx, keys: Keys, per_block: float) -> float:
        if ctx.tokens is not None:
            return len(ctx.tokens)
        if keys.mode == "tokens":
            return len(prompt_token_ids(ctx.body) or ()) or len(keys.chain) * per_block
        return max(len(ctx.raw_body) / BYTES_PER_TOKEN, len(keys.chain) * per_block, 1)

    def _routed(self, ctx, chosen: tuple, prompt: float, now: float, rows: list) -> None:
        """Put the request on its upstream's lane (off the lane of an attempt before)."""
        t, up, ahead, cached, _ = chosen
        before = ctx.state.get(STATE_KEY)
        if before is not None and before.key:
            self.queue.remove(before.name, before.key, now, answered=False)
        own = prompt - cached
        ctx.state[STATE_KEY] = Routed(up.name, self.queue.add(up.name, own, now), cached, own,
                                      ahead, t, retried=before is not None)
        self._unsettled = (ctx, rows, now)

    def _settle(self) -> None:
        """The last decision's request is on the upstream the gateway picked, which another
        scorer of the chain (its weight, a session's bonus) may have made another than this
        one's choice: then its prefill work moves to that upstream's lane, as predicted there.
        Called before the next decision and at answers: by then the pick is known."""
        last = self._unsettled
        if last is None:
            return
        self._unsettled = None
        ctx, rows, at = last
        r = ctx.state.get(STATE_KEY)
        up = ctx.prefill_upstream or ctx.upstream
        if r is None or up is None or up.name == r.name or not r.key:
            return
        row = next((row for row in rows if row[1] is up), None)
        if row is None:
            return
        t, _, ahead, cached, _ = row
        own = r.own + r.cached - cached
        self.queue.remove(r.name, r.key, at, answered=False)
        r.name, r.key = up.name, self.queue.add(up.name, own, at)
        r.cached, r.own, r.ahead, r.predicted_s, r.moved = cached, own, ahead, t, True

    # --- what the answer teaches -------------------------------------------------------------
    def answered(self, ctx) -> None:
        """The first byte: the chosen upstream has computed the prompt."""
        self._settle()
        r = ctx.state.get(STATE_KEY)
        if r is not None and r.key:
            self.queue.remove(r.name, r.key, self.clock(), answered=True)
            r.key, r.answered = 0, True

    def finished(self, ctx, error) -> None:
        self._settle()
        r = ctx.state.get(STATE_KEY)
        if r is None:
            return
        if r.key:                               # failed before its first byte
            self.queue.remove(r.name, r.key, self.clock(), answered=False)
            r.key = 0
            return
        if not r.answered or r.retried or r.moved or error is not None or ctx.status != 200:
            return
        measured = self._measured(ctx, r)
        if measured is not None and measured > 0:
            self._learn(ctx, r, measured)

    @staticmethod
    def _measured(ctx, r: Routed) -> float | None:
        """The seconds to the first token on the chosen upstream (None: not measured)."""
        if ctx.attempts != 1:
            return None
        prefill = ctx.prefill_upstream
        if prefill is not None:                 # P/D: its prefill leg
            return ctx.prefill_s if prefill.name == r.name else None
        if not ctx.stream or ctx.upstream is None or ctx.upstream.name != r.name:
            return None
        return ctx.upstream_s

    def _learn(self, ctx, r: Routed, measured: float) -> None:
        own = r.own
        if ctx.prefill_upstream is None:
            answer = ctx.usage
            if answer is None and ctx.tail:
                answer = (usage.from_stream(ctx.tail) or {}).get("usage")
            prompt, cached, _ = usage.tokens(answer)
            if prompt is not None:
                own = max(prompt - (cached if cached is not None else r.cached), 1)
        self.errors.labels(r.name).observe(abs(r.predicted_s - measured) / measured)
        self.model.observe(r.name, ctx.model, r.ahead + own, measured, self.clock())


def _header_times(chosen, runner_up) -> str:
    text = f"{chosen[1].name}:{chosen[0] * 1e3:.1f}"
    if runner_up is not None:
        text += f",{runner_up[1].name}:{runner_up[0] * 1e3:.1f}"
    return text


def _most(rows: list) -> list:
    """Those of `rows` holding the most leading blocks of the prompt (all, where none holds
    one)."""
    if len(rows) > 1:
        most = max(row[4] for row in rows)
        if most:
            return [row for row in rows if row[4] == most]
    return rows


def sole_longest(matched: dict[str, int], upstreams, least: float = 1):
    """The one candidate that holds more leading blocks of the prompt than every other, and
    at least `least` of them (None: nobody does, or two hold the most)."""
    best, best_m, runner_m = None, 0, 0
    for u in upstreams:
        m = matched.get(u.name, 0)
        if m > best_m:
            best, best_m, runner_m = u, m, best_m
        elif m > runner_m:
            runner_m = m
    return best if best_m > runner_m and best_m >= least else None
