"""How fast each upstream prefills, learned from its own answers: TTFT ≈ overhead + tokens / rate.

One `PrefillFit` per (upstream, model): a running least-squares line of the seconds an
upstream took against the prompt tokens it had to compute, refitted on every answered
request (`policy: predicted_ttft`, predicted_ttft.py, feeds it):

- decaying: every observation's weight halves each `half_life_s`, so a backend that slowed
  down (a noisy neighbour, a throttled GPU) is seen within a few half-lives;
- robust: a residual is clipped at CLIP_SCALES times the running mean absolute residual
  (Huber's idea), so one request stuck behind a stall moves the line by a bounded amount,
  while a real slowdown, seen again and again, widens the bound and gets through. The first
  YOUNG observations are clipped only at YOUNG_CLIP times the prediction: a prior can be off
  several times over (a CPU engine against the default prior: 6×), and there is no fit yet to
  protect, only a stall to bound;
- anchored: the previous line counts as ANCHOR_WEIGHT observations at 0 and at the mean
  token count, which keeps the slope defined while the requests all have one length, and
  holds the line where it was while no request comes (no traffic is no news); fed through
  `TTFTModel.observe`, the anchor is instead the fleet's line (every upstream's answers for
  the model), at FLEET_WEIGHT observations per upstream: one replica of many, routing to many
  upstreams, hears from each rarely, and a few answers that waited behind the other replicas'
  work made an upstream look slow, and its prefixes spill, where the fleet's line knew better
  (16 replicas at 64 upstreams in the fleet simulator, 120% load: 0.83x one replica's hit
  rate before, 0.95x with it, docs/routing.md); an upstream with many answers, or one of few
  upstreams, keeps its own rate. The anchor's second point sits at ANCHOR_MIN_TOKENS at
  least: a replica's first answer from an upstream is often a prompt another replica put
  there, a few tokens computed, which tells where the line starts, not its slope (anchored
  at those few tokens, one such answer read 1.5-3x the fleet's rate, and pulled the
  replica's prompts there: docs/routing.md);
- seeded: a new upstream starts from `prior` (configured), else from the fleet's median fit
  for the model, else from DEFAULT_PRIOR.

Rates are kept within [MIN_RATE, MAX_RATE] and overheads non-negative, so one odd answer never
makes an upstream look free or dead.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily

CLIP_SCALES = 3.0          # residuals beyond this many mean absolute residuals are clipped
YOUNG, YOUNG_CLIP = 8, 4.0   # the first observations: residuals up to 4x the prediction
REL_FLOOR = 0.1            # ... never below this fraction of the prediction (a quiet start)
SCALE_ALPHA = 0.05         # the mean absolute residual's smoothing per observation
ANCHOR_WEIGHT = 2.0        # observations' worth of the previous line
MIN_RATE, MAX_RATE = 1.0, 1e8          # tokens per second
ANCHOR_TOKENS = 1000.0     # where the anchor's second point sits before any data
# ... and at least, after: at 1,000 a backend at half speed was learned too slowly (1.38x after
# 70 answers, tests/plugins/test_predicted_ttft.py); 500 and 1,000 kept 16 replicas at 0.96x
# and 0.97x one replica's hit rate in the fleet simulator (docs/routing.md)
ANCHOR_MIN_TOKENS = 500.0
# an upstream's fit is anchored to the fleet's line with this many observations' worth per
# upstream of the model: where answers from each of many upstreams are few (one of many
# replicas, many upstreams), each is predicted about as the fleet is; an upstream with many
# (decayed) answers, or one of a few, by its own
FLEET_WEIGHT = 2.0


@dataclass(frozen=True, slots=True)
class Prior:
    tokens_per_s: float
    overhead_s: float


DEFAULT_PRIOR = Prior(10_000.0, 0.02)


class PrefillFit:
    """TTFT = overhead_s + per_token_s × tokens, fitted online (module doc)."""
    __slots__ = ("overhead_s", "per_token_s", "half_life_s", "observations", "_w", "_x", "_y",
                 "_xx", "_xy", "_t", "_scale")

    def __init__(self, prior: Prior, half_life_s: float, now: float):
        self.overhead_s = prior.overhead_s
        self.per_token_s = 1.0 / prior.tokens_per_s
        self.half_life_s = half_life_s
        self.observations = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0    # decayed weighted sums
        self._t = now
        self._scale: float | None = None       # mean absolute residual, seconds

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.per_token_s

    def predict(self, tokens: float) -> float:
        """Seconds to the first token for `tokens` to compute."""
        return self.overhead_s + self.per_token_s * tokens

    def observe(self, tokens: float, seconds: float, now: float,
                anchor: PrefillFit | None = None, anchor_weight: float = ANCHOR_WEIGHT) -> None:
        """One answered request: `tokens` computed (or waited for) in `seconds`; `anchor`:
        the line the data is anchored to with `anchor_weight` observations' worth (the
        fleet's; None: this fit's previous line)."""
        self._decay(now)
        expected = self.predict(tokens)
        residual = seconds - expected
        if self.observations < YOUNG:
            bound = YOUNG_CLIP * expected
        else:
            bound = CLIP_SCALES * max(self._scale or 0.0, REL_FLOOR * expected)
        clipped = min(max(residual, -bound), bound)
        self._scale = (abs(clipped) if self._scale is None
                       else self._scale + SCALE_ALPHA * (abs(clipped) - self._scale))
        y = expected + clipped
        self._w += 1.0
        self._x += tokens
        self._y += y
        self._xx += tokens * tokens
        self._xy += tokens * y
        self.observations += 1
        self._solve(anchor, anchor_weight)

    def _decay(self, now: float) -> None:
        dt = now - self._t
        if dt <= 0:
            return
        self._t = now
        f = 0.5 ** (dt / self.half_life_s)
        self._w *= f
        self._x *= f
        self._y *= f
        self._xx *= f
        self._xy *= f

    def _solve(self, anchor: PrefillFit | None = None, weight: float = ANCHOR_WEIGHT) -> None:
        """The weighted least-squares line through the data and the anchor's line (the
        previous line, or the fleet's)."""
        if anchor is None:
            a0, b0, k = self.overhead_s, self.per_token_s, ANCHOR_WEIGHT
        else:
            a0, b0, k = anchor.overhead_s, anchor.per_token_s, weight
        xr = max(self._x / self._w, ANCHOR_MIN_TOKENS) if self._w > 0 else ANCHOR_TOKENS
        yr = a0 + b0 * xr
        w = self._w + 2 * k
        sx = self._x + k * xr
        sy = self._y + k * (a0 + yr)
        sxx = self._xx + k * xr * xr
        sxy = self._xy + k * xr * yr
        var = sxx - sx * sx / w
        if var <= 0:
            return
        b = (sxy - sx * sy / w) / var
        a = (sy - b * sx) / w
        if a < 0:                            # a line through the origin: no negative overhead
            a, b = 0.0, sxy / sxx
        self.overhead_s = a
        self.per_token_s = min(max(b, 1.0 / MAX_RATE), 1.0 / MIN_RATE)


class TTFTModel:
    """Every (upstream, model)'s PrefillFit, created on first use (module doc)."""

    def __init__(self, prior: Prior | None, half_life_s: float):
        self.prior = prior                   # None: the fleet's fit, else DEFAULT_PRIOR
        self.half_life_s = half_life_s
        self.fits: dict[str | None, dict[str, PrefillFit]] = {}     # model -> upstream -> fit
        self.fleet: dict[str | None, PrefillFit] = {}       # model -> every upstream's answers

    def observe(self, name: str, model: str | None, tokens: float, seconds: float,
                now: float) -> None:
        """One answer of upstream `name`: its fit learns it, anchored to the fleet's line."""
        fleet = self.fleet.get(model)
        if fleet is None:
            fleet = self.fleet[model] = PrefillFit(self.prior or DEFAULT_PRIOR,
                                                   self.half_life_s, now)
        fleet.observe(tokens, seconds, now)
        fit = self.fit(name, model, now)
        fit.observe(tokens, seconds, now, fleet, FLEET_WEIGHT * len(self.fits[model]))

    def of(self, model: str | None) -> dict[str, PrefillFit]:
        """The fits of `model`'s upstreams (filled by `fit`)."""
        fits = self.fits.get(model)
        if fits is None:
            fits = self.fits[model] = {}
        return fits

    def fit(self, name: str, model: str | None, now: float) -> PrefillFit:
        """Upstream `name`'s fit for `model`, seeded when new."""
        fits = self.of(model)
        fit = fits.get(name)
        if fit is None:
            fit = fits[name] = PrefillFit(self._seed(fits), self.half_life_s, now)
        return fit

    def _seed(self, fits: dict[str, PrefillFit]) -> Prior:
        if self.prior is not None:
            return self.prior
        learned = [f for f in fits.values() if f.observations]
        if not learned:
            return DEFAULT_PRIOR
        return Prior(statistics.median(f.tokens_per_s for f in learned),
                     statistics.median(f.overhead_s for f in learned))

    def retain(self, names) -> None:
        """Forget the upstreams that left."""
        for fits in self.fits.values():
            for gone in [n for n in fits if n not in names]:
                del fits[gone]

    def collect(self):
        """`prefixgate_route_prefill_tokens_per_second` and `..._overhead_seconds`, per
        upstream and model ("" for requests without one)."""
        rate = GaugeMetricFamily("prefixgate_route_prefill_tokens_per_second", "Prefill rate "
                                 "learned per upstream and model (uncached prompt tokens per "
                                 "second)", labels=["upstream", "model"])
        overhead = GaugeMetricFamily("prefixgate_route_prefill_overhead_seconds", "Fixed time "
                                     "to first token learned per upstream and model (network, "
                                     "tokenizing, the first decode step)",
                                     labels=["upstream", "model"])
        for model, fits in self.fits.items():
            for name, fit in fits.items():
                rate.add_metric([name, model or ""], fit.tokens_per_s)
                overhead.add_metric([name, model or ""], fit.overhead_s)
        yield rate
        yield overhead
