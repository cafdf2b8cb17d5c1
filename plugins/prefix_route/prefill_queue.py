"""The prefill work waiting at each upstream, as this gateway knows it: in tokens, not requests.

Each request routed by `policy: predicted_ttft` adds its uncached prompt tokens to its
upstream's lane at the decision and takes them out at its first byte (the upstream has
computed its prompt) or when it fails without one. What is ahead of a new request is the
lane's total, less what the upstream has most likely done of the oldest request since the
lane last moved (a first byte, or work arriving at an idle upstream): an engine computes
prompts roughly in arrival order. An oldest request past the time its work takes waits behind
work this gateway does not see (other replicas', a long prompt they sent): as much more as it
has waited beyond its time is counted ahead, so a replica stops sending to an upstream its
own requests show stuck, seconds before any answer could tell it.

Other gateway replicas' requests are not in the lanes; where `poll_metrics_s` scrapes the
backends, requests the backend says are waiting beyond this gateway's own count each add the
lane's mean request size (`ahead(..., waiting=)`).
"""
from __future__ import annotations

MEAN_ALPHA = 0.05           # the mean request size's smoothing per request


class Lane:
    __slots__ = ("pending", "tokens", "head_key", "head", "since", "mean")

    def __init__(self):
        self.pending: dict[int, float] = {}    # request key -> its tokens, oldest first
        self.tokens = 0.0                      # their sum
        self.head_key, self.head = 0, 0.0      # the oldest one (read on every decision)
        self.since = 0.0                       # when the oldest request's work last moved
        self.mean = 0.0                        # mean tokens per request routed here

    def ahead(self, now: float, per_token_s: float, waiting: float | None = None) -> float:
        """The tokens the upstream still has to compute before a request sent now."""
        tokens = self.tokens
        if tokens:
            done = (now - self.since) / per_token_s
            # past its time the oldest request waits behind work this gateway does not see
            # (other replicas'): as much more as it has waited beyond its time
            tokens += done - 2 * self.head if done > self.head else -done
        if waiting is not None and waiting > len(self.pending):
            tokens += (waiting - len(self.pending)) * self.mean
        return tokens


class PrefillQueue:
    """One Lane per upstream name (module doc)."""

    def __init__(self):
        self.lanes: dict[str, Lane] = {}
        self._next_key = 0

    def lane(self, name: str) -> Lane:
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = Lane()
        return lane

    def add(self, name: str, tokens: float, now: float) -> int:
        """`tokens` routed to `name` now; the key that `remove` takes."""
        lane = self.lane(name)
        key = self._next_key = self._next_key + 1
        if not lane.pending:
            lane.since, lane.head_key, lane.head = now, key, tokens
        lane.pending[key] = tokens
        lane.tokens += tokens
        lane.mean = lane.mean + MEAN_ALPHA * (tokens - lane.mean) if lane.mean else tokens
        return key

    def remove(self, name: str, key: int, now: float, answered: bool) -> None:
        """The request `key` is off `name`'s lane: `answered` (its first byte came: the lane
        moved) or failed."""
        lane = self.lanes.get(name)
        if lane is None:
            return
        tokens = lane.pending.pop(key, None)
        if tokens is None:
            return
        lane.tokens = lane.tokens - tokens if lane.pending else 0.0   # no drift when empty
        if key == lane.head_key:
            lane.head_key, lane.head = next(iter(lane.pending.items()), (0, 0.0))
        if answered:
            lane.since = now

    def retain(self, names) -> None:
        for gone in [n for n in self.lanes if n not in names]:
            del self.lanes[gone]
