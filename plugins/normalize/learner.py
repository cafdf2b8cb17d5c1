"""Learned detector: values seen to vary between requests that share one template.

A text's *template* is the text with every digit-bearing word cut out; its *slots* are those
words, in order (`detectors.scan`). A slot is the whole word — "A1017", "e3b0c442-…",
"1,234.50" — so a value that starts with a letter one time and a digit the next, or grows a
thousands separator, leaves the template as it was: requests of one prompt template keep one
key however their spans vary in length, and whatever punctuation or CJK text stands around
them. Requests whose templates are equal come from the same prompt template, so a
slot that shows `after` different values across them is filled in per request — dynamic, even
when no typed detector knows its form. Only slots actually seen to vary are ever reported: a
version number, a price or a fixed date in the same template never varies, so it never moves.
One request alone teaches nothing.

Memory is bounded: at most `max_templates` templates (least recently used dropped), each with
at most `max_slots` slots (longer templates are not learned), each slot remembering at most
`after` distinct value hashes. A Learner knows one model's traffic: the normalize plugin keeps
one per model (`Normalizer.learner_for`, at most `MAX_MODELS`, least recently used dropped).
"""
from __future__ import annotations

from prefixgate.proxy.lru import LRU


class Template:
    __slots__ = ("first", "seen", "learned")

    def __init__(self, values: list[str]):
        self.first = values                     # slot values of the first request seen
        self.seen: dict[int, set[int]] = {}     # varying slot -> distinct value hashes (capped)
        self.learned: frozenset[int] = frozenset()


def template_key(statics: list[str]) -> int:
    """A prompt template's key: the text's static pieces, i.e. the text with its slots cut out.
    Python's own str hash (cached on each string, salted per process) is enough: the learner
    lives in one process, and pieces reused from a cached analysis hash for free."""
    return hash(tuple(statics))


class Learner:
    def __init__(self, after: int = 3, max_templates: int = 256, max_slots: int = 2048):
        self.after = after
        self.max_templates = max_templates
        self.max_slots = max_slots
        self.templates: LRU[int, Template] = LRU(max_templates)

    def observe(self, key: int, values: list[str]) -> frozenset[int]:
        """Record one request's slot values; return the slots learned to be dynamic."""
        if len(values) > self.max_slots:
            return frozenset()
        t = self.templates.get(key)
        if t is None:
            self.templates.put(key, Template(values))
            return frozenset()
        if values is t.first or len(values) != len(t.first):
            return t.learned
        changed = [i for i, (a, b) in enumerate(zip(t.first, values)) if a != b]
        if changed:
            self._count(t, changed, values)
        return t.learned

    def _count(self, t: Template, changed: list[int], values: list[str]) -> None:
        new = []
        for i in changed:
            if i in t.learned:
                continue
            hs = t.seen.get(i)
            if hs is None:
                hs = t.seen[i] = {hash(t.first[i])}
            hs.add(hash(values[i]))
            if len(hs) >= self.after:
                new.append(i)
                del t.seen[i]               # learned: its hashes are no longer needed
        if new:
            t.learned = t.learned | frozenset(new)

    def learned(self, key: int) -> frozenset[int]:
        t = self.templates.peek(key)            # a look only: recency is observe()'s
        return t.learned if t is not None else frozenset()

    def size(self) -> tuple[int, int]:
        """(templates, remembered value hashes): what the memory bound is about."""
        return len(self.templates), sum(len(h) for t in self.templates.values()
                                        for h in t.seen.values())
