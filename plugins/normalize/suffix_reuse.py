"""Reuse the analysis of a previous text that ends the same way.

Per-request values sit near the head of a prompt; the long rest is the same every time. When
a text shares a long suffix with one analysed before, only its head is scanned: the tokens and
finds of the shared part are taken from the old analysis, shifted by the length difference.

The result must equal a full analysis, so the split is placed where nothing can differ: at
a newline at least `MARGIN` characters inside the shared suffix. Tokens never contain a
newline; a label is looked for at most `detectors.WINDOW` characters before its value, and a
clause never reaches past its own line — so everything after that newline sees identical
text (an environment block reaches down its own lines only: one that starts above the split
and runs past it makes the head's finds reach across, which sends the caller to a full
analysis). Where a guarantee cannot be checked cheaply (a find reaching across the split, code
spans that differ, custom rules) the caller falls back to a full analysis.

The finds here are the detector's candidates: whether one is only mentioned (in a few-shot
example, say) can depend on a heading far above it, so `mentions` runs afterwards, over the
whole text.
"""
from __future__ import annotations

from bisect import bisect_left

from prefixgate.plugins.normalize.detectors import WINDOW, Found, scan

MARGIN = WINDOW + 56        # > the label window, with room for a separator and a prefix word
BLOCK = 1024                # suffix compared block by block, from the end


def common_suffix(a: str, b: str) -> int:
    """Length of the longest common suffix of `a` and `b`: slices of BLOCK chars from the end,
    then a bisection over the last block (a suffix is common only if every shorter one is), so
    the cost is a few memcmp-speed slice compares, not one Python step per character."""
    la, lb = len(a), len(b)
    n = min(la, lb)
    k = 0
    while k + BLOCK <= n and a[la - k - BLOCK:la - k] == b[lb - k - BLOCK:lb - k]:
        k += BLOCK
    lo, hi = k, min(n, k + BLOCK)       # the suffix of length lo is common; none past hi is
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[la - mid:la - k] == b[lb - mid:lb - k]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def reuse(text: str, code, old_text: str, old_toks, old_statics, old_values, old_found,
          old_code, detector):
    """(toks, statics, values, found) for `text`, reusing the old text's analysis; None when
    the texts do not share enough, or reuse could differ from a full analysis."""
    shared = common_suffix(text, old_text)
    b_new = len(text) - shared
    cut = text.find("\n", b_new + MARGIN)
    if cut < 0:
        return None
    delta = len(text) - len(old_text)
    old_cut = cut - delta
    if not _same_code_after(code, old_code, cut, old_cut, delta):
        return None
    head_toks, head_statics, head_values = scan(text[:cut])
    found = detector.candidates(text, head_toks, code, cut)
    if any(f.end > cut or (f.cut is not None and f.cut[1] > cut + 1) for f in found):
        return None
    i = bisect_left(old_toks, (old_cut, -1))
    j = bisect_left([f.start for f in old_found], old_cut)
    tail_found = old_found[j:]
    if any(f.end > old_cut for f in old_found[:j]) or \
            any((f.cut[0] if f.cut else f.start) <= old_cut for f in tail_found):
        return None                  # an old find reaches across the split
    next_start = old_toks[i][0] if i < len(old_toks) else len(old_text)
    statics = head_statics[:-1] + [head_statics[-1] + old_text[old_cut:next_start]] + \
        old_statics[i + 1:]
    toks = head_toks + [(s + delta, e + delta) for s, e in old_toks[i:]]
    found += [_shift(f, delta) for f in tail_found]
    return toks, statics, head_values + old_values[i:], found


def _same_code_after(code, old_code, cut, old_cut, delta) -> bool:
    """Code spans after the split are the old ones shifted, and none straddles the split."""
    if not code and not old_code:
        return True
    if any(s < cut < e for s, e in code) or any(s < old_cut < e for s, e in old_code):
        return False
    return [(s - delta, e - delta) for s, e in code if s >= cut] == \
        [sp for sp in old_code if sp[0] >= old_cut]


def _shift(f: Found, d: int) -> Found:
    return Found(f.start + d, f.end + d, f.value, f.label, f.type,
                 None if f.cut is None else (f.cut[0] + d, f.cut[1] + d),
                 f.at + d if f.at >= 0 else f.at)
