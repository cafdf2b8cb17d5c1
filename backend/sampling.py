"""Sampling: per-request parameters, the batched sampler, draft verification, the stop checks.

A batch mixes greedy and random requests. Greedy rows take the argmax; random rows are scaled
by their temperature, cut by top-k and top-p, and drawn by inverse CDF with one uniform each,
from the row's own generator where the request is seeded. Top-k/top-p rows never sort the
whole vocabulary when their kept set lies among the CANDIDATES highest logits (torch.topk,
`_kept_sorted`): the same kept set as a full sort, at a fraction of the cost (issue #29,
bench/sampling_cost.py); the draw then runs over the kept tokens only. (`verify` still draws its
replacement tokens with the exponential race, argmax of p / Exp(1) noise, over `_filtered_probs`.)

`verify` checks speculative drafts (backend/spec_decode.py) against the target's own
distributions, so that the output is distributed exactly as without drafts: a greedy row keeps
draft tokens while they equal the argmax; a random row keeps draft token d with probability
p(d) and, at the first rejection, draws from p with d removed (speculative sampling, Leviathan
et al. 2023, with a draft distribution that is all on d). Every draft kept, one more token is
drawn from the distribution after the last one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0        # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 (or -1) disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        # Below ~1e-5 dividing by the temperature overflows the logits: that is greedy anyway.
        return self.temperature < _MIN_TEMPERATURE or self.top_k == 1

    def make_generator(self, device="cpu") -> torch.Generator | None:
        """A private generator for a seeded request, so its draws don't depend on its batch."""
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


# Top-k/top-p rows look for their kept set among this many highest logits first (torch.topk)
# and sort the whole row only when it is not there (`_kept_sorted`).
CANDIDATES = 1024


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           candidates: int | None = CANDIDATES) -> list[int]:
    """One token id per row of `logits` [N, vocab] (float32).

    `candidates=None` is the full-sort path the sampler had before (issue #29): every filtered
    row sorted whole, full-vocabulary probabilities, the exponential race over all of them. It
    keeps exactly the same tokens as the default path and stays for bench/sampling_cost.py and the
    tests."""
    rand_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rand_rows:
        return logits.argmax(dim=-1).tolist()
    dev = logits.device
    gens = [generators[i] for i in rand_rows]
    rand_params = [params[i] for i in rand_rows]
    if len(rand_rows) == len(params):
        rows, tokens, idx = logits, None, None
    else:
        idx = torch.tensor(rand_rows, device=dev)
        rows = logits[idx]
        tokens = logits.argmax(dim=-1)
    if candidates is None:
        drawn = _race(_filtered_probs(rows, rand_params, candidates=None), gens)
    else:
        drawn = _draw(rows, rand_params, gens, candidates)
    if tokens is None:
        return drawn.tolist()
    tokens[idx] = drawn
    return tokens.tolist()


def _race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of `probs` [N, vocab]: argmax of p / Exp(1) noise, row i's noise from
    generators[i]."""
    noise = torch.empty_like(probs)
    for j, gen in enumerate(generators):
        noise[j].exponential_(generator=gen)
    return probs.div_(noise).argmax(dim=-1)


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[list[int]]:
    """The tokens each sequence keeps: its accepted draft prefix and one token of the target's.

    Sequence i owns len(drafts[i]) + 1 consecutive rows of `logits` (float32): the
    distributions after its last token and after each of its draft tokens."""
    greedy = logits.argmax(dim=-1).tolist()
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    out: list[list[int]] = []
    rand = []                           # random sequences: (i, the rows they own)
    for i, (d, p) in enumerate(zip(drafts, params)):
        if p.greedy:
            rows = greedy[starts[i]:starts[i + 1]]
            n = next((j for j, tok in enumerate(d) if tok != rows[j]), len(d))
            out.append(d[:n] + [rows[n]])
        else:
            out.append([])
            rand.append(i)
    if rand:
        _verify_random(logits, drafts, params, generators, starts, rand, out)
    return out


def _verify_random(logits, drafts, params, generators, starts, rand, out) -> None:
    dev = logits.device
    rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=dev) for i in rand])
    probs = _filtered_probs(logits[rows], [params[i] for i in rand
                                           for _ in range(len(drafts[i]) + 1)])
    # p(d) of every draft token, against a uniform draw each from the sequence's own generator
    offsets, chances, draws = [0], [], []
    for i in rand:
        k = len(drafts[i])
        offsets.append(offsets[-1] + k + 1)
        if k:
            at = torch.arange(offsets[-2], offsets[-2] + k, device=dev)
            chances.append(probs[at, torch.tensor(drafts[i], device=dev)])
            draws.append(torch.rand(k, generator=generators[i], device=dev, dtype=probs.dtype))
    accept = (torch.cat(draws) < torch.cat(chances)).tolist() if chances else []
    final_rows, rejected, pos = [], [], 0
    for j, i in enumerate(rand):
        k = len(drafts[i])
        n = next((t for t in range(k) if not accept[pos + t]), k)
        pos += k
        out[i] = drafts[i][:n]
        final_rows.append(offsets[j] + n)
        rejected.append(drafts[i][n] if n < k else None)
    final = probs[torch.tensor(final_rows, device=dev)]
    for r, tok in enumerate(rejected):
        if tok is not None:             # the residual (p - q)+ of a one-hot draft q: p without d
            final[r, tok] = 0.0
    tokens = _race(final, [generators[i] for i in rand]).tolist()
    for i, tok in zip(rand, tokens):
        out[i].append(tok)


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], device=logits.device,
                         dtype=logits.dtype)
    return logits / temps.unsqueeze(1)


def _cuts(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p removes anything from a row of `vocab` tokens."""
    return 0 < p.top_k < vocab or p.top_p < 1.0


def _draw(logits: torch.Tensor, params: list[SamplingParams],
          generators: list[torch.Generator | None], candidates: int) -> torch.Tensor:
    """One token per row (all random rows), by inverse CDF over the row's kept set: rows that
    top-k/top-p cut over their kept head in sorted order (`_kept_sorted`), the others over the
    whole vocabulary."""
    n, vocab = logits.shape
    dev = logits.device
    scaled = _scaled(logits, params)
    out = torch.empty(n, dtype=torch.long, device=dev)
    cut = [i for i, p in enumerate(params) if _cuts(p, vocab)]
    plain = [i for i, p in enumerate(params) if not _cuts(p, vocab)]
    if plain:
        x = scaled if len(plain) == n else scaled[torch.tensor(plain, device=dev)]
        w = x.sub_(x.max(dim=-1, keepdim=True).values).exp_()      # x is ours to overwrite
        full = torch.full((len(plain),), vocab, device=dev)
        out[plain] = _inverse_cdf(w, full, [generators[i] for i in plain])
    if cut:
        cut_idx = torch.tensor(cut, device=dev)
        sub = scaled if len(cut) == n else scaled[cut_idx]
        groups = _kept_sorted(sub, [params[i].top_k for i in cut], [params[i].top_p for i in cut],
                              candidates)
        for rows, vals, ids, m in groups:
            width = int(m.max())
            w = vals[:, :width].sub(vals[:, :1]).exp_()
            pick = _inverse_cdf(w, m, [generators[cut[r]] for r in rows.tolist()])
            out[cut_idx[rows]] = ids.gather(1, pick.unsqueeze(1)).squeeze(1)
    return out


def _inverse_cdf(w: torch.Tensor, m: torch.Tensor,
                 generators: list[torch.Generator | None]) -> torch.Tensor:
    """One position per row of the weights `w` [N, W] (>= 0, not normalised), drawn among the
    first m[i] of row i with probability proportional to the weight: the first position whose
    cumulative weight exceeds a uniform fraction of the row's total. The sums are float64, so
    every position keeps its share to ~1e-16 of the total. One uniform per row, row i's from
    generators[i] (the global generator for None): a seeded row's draws depend on its own
    kept set only, never on its batch companions."""
    n, width = w.shape
    dev = w.device
    if bool((m < width).any()):
        w = w.masked_fill(torch.arange(width, device=dev) >= m.unsqueeze(1), 0.0)
    cdf = w.cumsum(dim=-1, dtype=torch.float64)
    total = cdf.gather(1, (m - 1).unsqueeze(1))
    u = torch.rand(n, 1, device=dev, dtype=torch.float64)
    for j, gen in enumerate(generators):
        if gen is not None:
            u[j] = torch.rand(1, generator=gen, device=dev, dtype=torch.float64)
    # u < 1, but u * total may round up to total: then the last kept position (p ~ 2^-53)
    pick = torch.searchsorted(cdf, u.mul_(total), right=True).squeeze(1)
    return torch.minimum(pick, m - 1)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams],
                    candidates: int | None = CANDIDATES) -> torch.Tensor:
    """Each row's distribution [N, vocab] after temperature, top-k and top-p (zero outside the
    kept set)."""
    n, vocab = logits.shape
    dev = logits.device
    scaled = _scaled(logits, params)
    cut = [i for i, p in enumerate(params) if _cuts(p, vocab)]
    if not cut:
        return torch.softmax(scaled, dim=-1)
    if len(cut) == n:
        probs, cut_idx, sub = torch.zeros_like(scaled), torch.arange(n, device=dev), scaled
    else:
        probs = torch.softmax(scaled, dim=-1)
        cut_idx = torch.tensor(cut, device=dev)
        sub = scaled[cut_idx]
    groups = _kept_sorted(sub, [params[i].top_k for i in cut], [params[i].top_p for i in cut],
                          candidates)
    for rows, vals, ids, m in groups:
        width = int(m.max())
        pos = torch.arange(width, device=dev)
        w = torch.softmax(vals[:, :width].masked_fill(pos >= m.unsqueeze(1), float("-inf")), -1)
        probs[cut_idx[rows]] = torch.zeros(len(rows), vocab, device=dev,
                                           dtype=probs.dtype).scatter_(1, ids[:, :width], w)
    return probs


def _kept_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                 candidates: int | None) -> list[tuple[torch.Tensor, ...]]:
    """The tokens top-k and top-p keep of each row of the (temperature-scaled) `logits`
    [N, vocab]: groups (rows, values [G, W] sorted descending, their token ids [G, W], kept
    counts m [G]); row rows[g] keeps the first m[g] tokens of its group's order. Ties are
    ordered by token id (a stable sort), so the kept set is a function of the logits alone.

    The cut is the full-sort rule: the top k, then the smallest head of those whose mass
    (normalised over the top k, or over the whole row where top-k cuts nothing) reaches top_p
    (a token is dropped when the mass before it reaches p; the first is always kept).
    With `candidates`, the rule runs first on torch.topk's `candidates` highest values (at
    least the largest top-k + 1), sorted the same way: their values, and so the masses and the
    cut, are those of the full sort's head (the whole row's normaliser is a logsumexp over the
    unsorted row), and a row whose last kept value is above the candidates' last one has its
    whole kept set among them (every other token's value is at most that last one; equal to it
    topk may have picked other ties than the sort would). The other rows (a wide nucleus)
    are sorted whole. `candidates=None`, or candidates near the vocabulary size: every row is
    sorted whole."""
    n, vocab = logits.shape
    dev = logits.device
    ks = [kk if 0 < kk < vocab else vocab for kk in top_k]
    k = torch.tensor(ks, device=dev)
    p = torch.tensor(top_p, device=dev, dtype=logits.dtype)
    kcap = max((kk for kk in ks if kk < vocab), default=0)
    z = torch.zeros(n, device=dev, dtype=logits.dtype)
    whole = [i for i in range(n) if top_p[i] < 1.0 and ks[i] == vocab]
    if whole:
        z[whole] = torch.logsumexp(logits if len(whole) == n else logits[whole], dim=-1)
    everything = torch.arange(n, device=dev)
    if candidates is None or 4 * max(candidates, kcap + 1) > vocab:
        vals, ids = logits.sort(dim=-1, descending=True, stable=True)
        return [(everything, vals, ids, _cut(vals, k, k < vocab, p, z, kcap))]
    vals, ids = logits.topk(max(candidates, kcap + 1), dim=-1)
    if bool((vals[:, 1:] == vals[:, :-1]).any()):       # ties: by token id, as the sort has them
        ids, perm = ids.sort(dim=-1)
        vals, perm = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, perm)
    m = _cut(vals, k, k < vocab, p, z, kcap)
    found = vals.gather(1, (m - 1).unsqueeze(1)).squeeze(1) > vals[:, -1]
    if bool(found.all()):
        return [(everything, vals, ids, m)]
    hit, miss = found.nonzero().squeeze(1), (~found).nonzero().squeeze(1)
    groups = [(hit, vals[hit], ids[hit], m[hit])] if hit.numel() else []
    fv, fi = logits[miss].sort(dim=-1, descending=True, stable=True)
    km = k[miss]
    groups.append((miss, fv, fi, _cut(fv, km, km < vocab, p[miss], z[miss], kcap)))
    return groups


def _cut(vals: torch.Tensor, k: torch.Tensor, k_cuts: torch.Tensor, p: torch.Tensor,
         z: torch.Tensor, kcap: int) -> torch.Tensor:
    """How many of each row's sorted `vals` [N, W] top-k k and top-p p keep: the head before
    the first dropped token. z: the row's log normaliser where top-k cuts nothing (k_cuts
    False); kcap: the largest k that cuts (its normaliser comes from the first kcap values)."""
    width = vals.shape[-1]
    drop = torch.arange(width, device=vals.device) >= k.unsqueeze(1)
    nucleus = p < 1.0
    if bool(nucleus.any()):
        if kcap:
            zk = torch.logsumexp(vals[:, :kcap].masked_fill(drop[:, :kcap], float("-inf")), -1)
            z = torch.where(k_cuts, zk, z)
        probs = (vals - z.unsqueeze(1)).exp_().masked_fill_(drop, 0.0)
        mass_before = probs.cumsum(dim=-1).sub_(probs)
        drop |= (mass_before >= p.unsqueeze(1)) & nucleus.unsqueeze(1)
    first = drop.to(torch.uint8).argmax(dim=-1)
    return torch.where(drop.any(dim=-1), first, width)


def stop_token_reason(token_id: int, num_output: int, params: SamplingParams,
                      eos_ids: set[int] | frozenset[int]) -> str | None:
    """Why generation stops after `token_id` (the `num_output`-th output token), or None."""
    if not params.ignore_eos and token_id in eos_ids:
        return "stop"
    if token_id in params.stop_token_ids:
        return "stop"
    if num_output >= params.max_tokens:
        return "length"
    return None


def find_stop_string(text: str, stop: list[str], start: int = 0) -> int:
    """Index in `text` where the earliest stop string begins (searching from `start`), or -1."""
    best = -1
    for s in stop:
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
