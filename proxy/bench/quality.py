"""`prefixgate bench --scenario quality`: the quality gate. A setting that changes the engine's
numerics (an FP8 KV cache, another attention backend, another dtype) is compared with the
baseline on the same prompts before it can be recommended.

    prefixgate bench --scenario quality --candidate kv_cache_dtype=fp8 --model smollm2
    prefixgate bench --scenario quality --candidate 'kv_cache_dtype=fp8;attention_backend=torch' \\
        --gate exact_match=0.5,top1_agreement=0.97 --contexts 1024,4096 --out gate.json

Each engine (the baseline, then each candidate; one at a time, on every core) answers, greedy:

  short set   `Suite.prompts` varied chat prompts, `Suite.max_tokens` tokens each. Measured:
              the share of outputs equal to the baseline's token for token (exact match), the
              median position of the first token that differs (no difference: max_tokens), and
              the top-1 agreement: teacher-forced on the baseline's continuation, the share of
              positions where the candidate's next-token argmax is the baseline's. The bundled
              engine has no `logprobs`, so each position is one probe request: the prompt and
              the baseline's first i output tokens as token ids, max_tokens 1 (a greedy token
              is the top-1). The probes of a prompt share its prefix, so the prefix cache
              leaves each at most a block of tokens to compute; the baseline is probed the
              same way.
  numbers     built-in documents (ledgers of invoices, crates, accounts, weights with numbers,
              between plain sentences without any digit), one per `Suite.contexts` length in
              tokens of the model's tokenizer (capped at the model's context); each followed by
              `Suite.questions` questions about facts near its start and middle. An answer is
              right when it quotes the fact's number (commas and a currency sign aside).

A candidate passes when every measure meets its threshold (`Thresholds`); one that does not is
reported and never recommended. The numbers share is compared with the baseline's own (a small
model quotes few numbers from 8k tokens at any precision: the gate asks for no worse, not for
good). Identical settings give identical greedy outputs, so the baseline passes against
itself with every measure at 1.0.

For a tuner: `gate = Gate(model, baseline_flags)`, then `verdict = await gate.check(flags)`
per grid point (the baseline runs once, on the first check); `flags_from_spec(spec)` turns
'kv_cache_dtype=fp8' into engine flags; `run_gate(...)` is the one-shot form. The gate's own
tests plant a fault below FP8's precision with the engine's hidden `--debug-kv-mantissa-bits N`
(stored K/V rounded to N mantissa bits).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

from prefixgate.backend.config import EngineArgs, flag_name, resolve_model, served_name
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench import target
from prefixgate.proxy.bench.prompts import load_tokenizer

# --- candidate specs: 'kv_cache_dtype=fp8,attention_backend=torch' -> engine flags -----------

# backend/model_runner.py's KV_CACHE_DTYPES, named here so the gateway's CLI need not load torch
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "float16", "bfloat16", "float32")
CHOICES = {"kv_cache_dtype": KV_CACHE_DTYPE_NAMES,
           "attention_backend": ("auto", "triton", "torch"),
           "dtype": ("float32", "bfloat16", "float16"),
           "load_format": ("mmap", "eager")}
# EngineArgs fields that are not a grid point's to change (what is served, and where)
NOT_SETTINGS = {"model", "tokenizer", "served_model_name", "role", "kv_transfer_host",
                "kv_transfer_port", "kv_transfer_timeout", "kv_events_config",
                "speculative_config", "kv_offloading_path"}
# booleans whose flag turns a default-on feature off
NEGATED = {"enable_chunked_prefill": "--no-chunked-prefill",
           "enable_prefix_caching": "--no-prefix-caching"}
_SETTINGS = {f.name: f for f in dataclasses.fields(EngineArgs) if f.name not in NOT_SETTINGS}


class SpecError(ValueError):
    """A candidate spec that names no engine setting, or a value the setting does not take."""


def flags_from_spec(spec: str) -> list[str]:
    """One grid point, `key=value` pairs joined by commas, as `prefixgate backend` flags (vLLM's
    names: the key's underscores become dashes): 'kv_cache_dtype=fp8' ->
    ['--kv-cache-dtype', 'fp8']; a boolean setting as 'enforce_eager' or 'enforce_eager=true'.
    '' or 'baseline' is the engine's defaults ([]). SpecError names the spec and what is wrong."""
    flags: list[str] = []
    text = spec.strip()
    if text in ("", "baseline"):
        return flags
    for item in text.split(","):
        key, eq, value = (s.strip() for s in item.strip().partition("="))
        key = key.replace("-", "_").lstrip("_")
        problem = _setting_problem(key, value, bool(eq))
        if problem:
            raise SpecError(f"candidate {spec!r}: {problem}")
        flags += _setting_flags(key, value, bool(eq))
    return flags


def _setting_problem(key: str, value: str, has_value: bool) -> str | None:
    f = _SETTINGS.get(key)
    if f is None:
        known = ", ".join(sorted(k for k in _SETTINGS if not k.startswith("debug_")))
        return f"{key!r} is no engine setting (one of: {known})"
    kind = str(f.type)
    if kind == "bool":
        if has_value and value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            return f"{key} takes true or false, got {value!r}"
        return None
    if not has_value or not value:
        return f"{key} needs a value ({key}=...)"
    if key in CHOICES and value not in CHOICES[key]:
        return f"{key} takes one of {', '.join(CHOICES[key])}, got {value!r}"
    if "int" in kind.split(" | ") and "str" not in kind and not re.fullmatch(r"-?\d+", value):
        return f"{key} takes an integer, got {value!r}"
    if "float" in kind.split(" | ") and not _is_number(value):
        return f"{key} takes a number, got {value!r}"
    return None


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _setting_flags(key: str, value: str, has_value: bool) -> list[str]:
    if str(_SETTINGS[key].type) != "bool":
        return [flag_name(key), value]
    on = not has_value or value.lower() in ("true", "1", "yes")
    if key in NEGATED:
        return [] if on else [NEGATED[key]]
    return [flag_name(key)] if on else []


def parse_candidates(texts: list[str]) -> list[str]:
    """`--candidate` values (each may hold several specs separated by ';') as a list of specs."""
    return [s.strip() for text in texts for s in text.split(";") if s.strip()]


# --- thresholds ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Thresholds:
    """What a candidate must reach (docs/benchmarks.md, "The quality gate", says why these).

    exact_match       share of short-set outputs equal to the baseline's, token for token
    top1_agreement    teacher-forced share of positions whose argmax is the baseline's
    numbers_drop      the numbers share may fall at most this far below the baseline's
    first_divergence  the median first differing position, as a share of max_tokens (0: not
                      gated, only reported)
    """
    exact_match: float = 0.2
    top1_agreement: float = 0.95
    numbers_drop: float = 0.1
    first_divergence: float = 0.0


def parse_thresholds(text: str, base: Thresholds = Thresholds()) -> Thresholds:
    """'exact_match=0.5,top1_agreement=0.97' over `base`; ValueError names a bad key or value."""
    names = [f.name for f in dataclasses.fields(Thresholds)]
    values = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        key = key.replace("-", "_")
        if key not in names:
            raise ValueError(f"--gate: {key!r} is no threshold (one of: {', '.join(names)})")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not eq or not 0.0 <= number <= 1.0:
            raise ValueError(f"--gate: {key} takes a number in [0, 1], got {value!r}")
        values[key] = number
    return dataclasses.replace(base, **values)


# --- the prompts -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Suite:
    """What every engine of a gate answers (the same for all: built once, from `seed`)."""
    prompts: int = 16                    # short chat prompts
    max_tokens: int = 32                 # greedy tokens per short prompt
    contexts: tuple[int, ...] = (1024, 4096, 8192)    # document lengths, in tokens
    questions: int = 6                   # per document (at most len(NEEDLES))
    answer_tokens: int = 32              # greedy tokens per answer
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.questions <= len(NEEDLES):
            raise ValueError(f"questions: at most {len(NEEDLES)} per document")
        if not 1 <= self.prompts <= len(TASKS) * len(TOPICS):
            raise ValueError(f"prompts: 1 to {len(TASKS) * len(TOPICS)}")
        if self.max_tokens < 1 or self.answer_tokens < 1:
            raise ValueError("max_tokens and answer_tokens must be positive")


TASKS = ("Write a short poem about {}.", "Explain {} to a ten-year-old.",
         "List three facts about {}.", "What are the main risks of {}?",
         "Give me two tips for getting started with {}.", "Describe {} in one paragraph.",
         "Write a friendly email inviting a colleague to talk about {}.",
         "What is the history of {} in a few sentences?")
TOPICS = ("the sea", "copper mining", "bread baking", "prime numbers", "city gardens",
          "electric cars", "the moon", "chess openings", "rain forests", "old bridges",
          "learning a language", "coffee", "bees", "winter storms", "public libraries",
          "mountain railways", "solar panels", "jazz", "tea ceremonies", "volcanoes")


def short_prompts(suite: Suite) -> list[list[dict]]:
    """`suite.prompts` varied chat requests (messages), the same for a given seed."""
    rng = random.Random(f"quality:{suite.seed}:short")
    pairs = [(t, p) for t in TASKS for p in TOPICS]
    rng.shuffle(pairs)
    return [[{"role": "user", "content": task.format(topic)}]
            for task, topic in pairs[:suite.prompts]]


FIRST = ("Harlow", "Brennan", "Ostrava", "Milford", "Quayle", "Dunmore", "Linden", "Petrov",
         "Ashgrove", "Calloway", "Ferris", "Whitcombe", "Norwood", "Okafor", "Sandoval",
         "Thistle", "Varga", "Yarrow", "Keswick", "Marlowe", "Redfern", "Galloway", "Ibarra")
SECOND = ("Supply", "Freight", "Textiles", "Hardware", "Bakery", "Timber", "Pharmacy",
          "Printing", "Dairy", "Optics", "Ceramics", "Marine", "Glassworks", "Orchards")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")


def _amount(rng: random.Random) -> str:
    return f"{rng.randrange(1000, 99999):,}.{rng.randrange(100):02d}"


# The facts asked about, one of each kind per document: (statement, question, value).
NEEDLES = (
    (lambda n, v, rng: f"The invoice from {n} was paid on {rng.randrange(1, 29)} "
                       f"{rng.choice(MONTHS)} for {v} dollars.",
     lambda n: f"For how many dollars was the invoice from {n} paid?", _amount),
    (lambda n, v, rng: f"The warehouse run by {n} holds {v} crates of spare parts.",
     lambda n: f"How many crates does the warehouse run by {n} hold?",
     lambda rng: f"{rng.randrange(120, 9999):,}"),
    (lambda n, v, rng: f"The bank account of {n} has the number {v}.",
     lambda n: f"What is the bank account number of {n}?",
     lambda rng: str(rng.randrange(1_000_000, 99_999_999))),
    (lambda n, v, rng: f"The last shipment for {n} weighed {v} kilograms.",
     lambda n: f"How many kilograms did the last shipment for {n} weigh?",
     lambda rng: f"{rng.randrange(100, 9999):,}.{rng.randrange(10)}"),
    (lambda n, v, rng: f"The lease signed by {n} runs for {v} months.",
     lambda n: f"For how many months does the lease signed by {n} run?",
     lambda rng: str(rng.randrange(13, 240))),
    (lambda n, v, rng: f"The loan taken by {n} carries interest of {v} percent.",
     lambda n: f"What interest rate, in percent, does the loan taken by {n} carry?",
     lambda rng: f"{rng.randrange(1, 19)}.{rng.randrange(1, 100):02d}"),
)
# Numbers of other kinds, never asked about: a document full of numbers, one answer each.
DISTRACTORS = (
    lambda rng: f"The office moved to room {rng.randrange(100, 999)} in "
                f"{rng.randrange(1950, 2020)}.",
    lambda rng: f"The staff of {rng.randrange(12, 90)} clerks met on {rng.randrange(1, 29)} "
                f"{rng.choice(MONTHS)}.",
    lambda rng: f"The porter's telephone extension was {rng.randrange(10, 99)}-"
                f"{rng.randrange(100, 999)}.",
    lambda rng: f"The building at {rng.randrange(2, 400)} Quay Street had "
                f"{rng.randrange(2, 9)} floors.",
    lambda rng: f"The stove burned {rng.randrange(3, 40)} sacks of coal each winter.",
)
SUBJECTS = ("The office on the north side of the river", "A clerk from the back room",
            "The manager", "The new apprentice", "An old map of the harbour", "The porter",
            "The senior bookkeeper", "A cat from the yard", "The partners", "The night watchman",
            "A trader from the coast", "The cashier")
PREDICATES = ("was quiet for most of that week", "checked the ledger twice before closing",
              "preferred letters to telephone calls", "waited by the window for the carts",
              "kept the lamps trimmed and the floors swept", "was mentioned in every report",
              "had seen better days but nobody complained", "listened to the rain on the roof",
              "answered each letter by hand", "stayed until the last cart was unloaded",
              "smelled of wet straw and lamp oil", "was the subject of much gossip")
TAILS = ("", " after the market closed", " during the long winter", " on most evenings",
         " when the frost came early", " while the street filled with traders",
         " before the accounts went to the bank", " as the tide came in")


def _filler(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(PREDICATES)}{rng.choice(TAILS)}."


DEPTHS = (0.05, 0.3, 0.5, 0.15, 0.4, 0.6)   # where the asked-about facts sit, by kind


@dataclass
class Question:
    context: int                 # the document's length target, in tokens
    prompt_ids: list[int]
    expected: str                # the number as the document writes it
    depth: float


def long_questions(suite: Suite, tokenizer, max_prompt_tokens: int) -> list[Question]:
    """Per context length, one document and `suite.questions` questions about it (prompt token
    ids: the document comes first, so the questions of a document share its prefix)."""
    out = []
    for context in suite.contexts:
        out += _document_questions(suite, tokenizer, min(context, max_prompt_tokens), context)
    return out


def _document_questions(suite: Suite, tok, budget: int, context: int) -> list[Question]:
    """Sentences without digits, a number of another kind every few, and one fact of each
    asked-about kind at its depth; cut to `budget` tokens with the longest question."""
    rng = random.Random(f"quality:{suite.seed}:doc:{context}")
    names = rng.sample([f"{a} {b}" for a in FIRST for b in SECOND], len(NEEDLES))
    needles = [(kind, name, kind[2](rng)) for kind, name in zip(NEEDLES, names)]
    head = "Records of the Eastbrook trading office.\n\n"
    tail = "\n\nQuestion: {} Answer with the number only."

    def render(sentences: list[str], question: str) -> list[int]:
        paragraphs = [" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5)]
        text = head + "\n\n".join(paragraphs) + tail.format(question)
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True))
    questions = [kind[1](name) for kind, name, _ in needles[:suite.questions]]
    longest = max(questions, key=lambda q: len(tok.encode(q)))
    room = budget - len(render([], longest))
    sentences: list[str] = []
    used = 0
    for kind, name, value in needles[:suite.questions]:
        sentence = kind[0](name, value, rng)
        sentences.append(sentence)
        used += len(tok.encode(" " + sentence))     # a space joins it to the one before
    filler: list[str] = []
    while True:
        sentence = (rng.choice(DISTRACTORS)(rng) if len(filler) % 4 == 3 else _filler(rng))
        cost = len(tok.encode(" " + sentence))
        if used + cost > room:
            break
        filler.append(sentence)
        used += cost
    asked = sentences
    while True:
        sentences = list(filler)
        # deepest first, so each position still counts filler sentences only
        for sentence, depth in sorted(zip(asked, DEPTHS), key=lambda pair: -pair[1]):
            sentences.insert(int(depth * len(filler)), sentence)
        if len(render(sentences, longest)) <= budget or not filler:
            break
        filler.pop()
    return [Question(context, render(sentences, q), value, depth)
            for q, (_, _, value), depth in zip(questions, needles, DEPTHS)]


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def quotes(answer: str, expected: str) -> bool:
    """Whether `answer` quotes the number `expected` (commas, a currency sign, trailing zeros
    of a decimal and a full stop after it aside)."""
    def value(text: str) -> float | None:
        try:
            return float(text.replace(",", ""))
        except ValueError:
            return None
    want = value(expected)
    return any(value(m.rstrip(",")) == want for m in _NUMBER.findall(answer))


# --- one engine's answers --------------------------------------------------------------------

@dataclass
class PointRun:
    """What one engine (one grid point) answered."""
    flags: list[str]
    outputs: list[list[int]]             # greedy token ids, per short prompt
    top1: list[list[int]]                # argmax after each prefix of the reference's output
    answers: list[str]                   # per long-context question
    texts: list[str] = field(default_factory=list)    # the short outputs, decoded
    max_model_len: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


@dataclass
class Inputs:
    """The prompts, as token ids, that every engine of a gate is sent."""
    short: list[list[int]]
    questions: list[Question]


# a gate measures answers, not latency: no warm-up run before the first request
ENGINE_ARGS = ["--log-level", "warning", "--skip-server-warmup"]


class Gate:
    """Compares grid points with a baseline on one model; the baseline runs once."""

    def __init__(self, model: str = "demo", baseline_flags: list[str] | None = None, *,
                 suite: Suite = Suite(), thresholds: Thresholds = Thresholds(),
                 threads: int | None = None, launcher=None, timeout: float = 1800.0,
                 tokenizer=None, log=None):
        self.model = model
        self.baseline_flags = list(baseline_flags or [])
        self.suite = suite
        self.thresholds = thresholds
        self.threads = threads or os.cpu_count() or 1      # one engine at a time: every core
        self.launcher = launcher
        self.timeout = timeout
        self.tokenizer = tokenizer
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.inputs: Inputs | None = None
        self.baseline: PointRun | None = None

    async def run_baseline(self) -> PointRun:
        if self.baseline is None:
            self.baseline = await self.measure(self.baseline_flags)
            if self.baseline.errors:
                raise RuntimeError(f"the baseline ({' '.join(self.baseline_flags) or 'defaults'})"
                                   f" failed: {self.baseline.errors[0]}")
        return self.baseline

    async def check(self, candidate_flags: list[str],
                    thresholds: Thresholds | None = None) -> dict:
        """The verdict on one grid point: every measure, its threshold, and `passed`."""
        base = await self.run_baseline()
        cand = await self.measure(candidate_flags, reference=base)
        return compare(base, cand, self.suite, thresholds or self.thresholds, self.inputs)

    async def measure(self, flags: list[str], reference: PointRun | None = None) -> PointRun:
        """Start an engine with `flags`, send it every prompt, stop it."""
        label = " ".join(flags) or "defaults"
        self.log(f"quality gate: {self.model} with {label}: starting the engine")
        t0 = time.monotonic()
        engines = await target.start_engines(["both"], ENGINE_ARGS + list(flags), self.threads,
                                             self.launcher, self.model)
        try:
            async with target.client_session(self.timeout) as session:
                client = _Client(session, engines.urls[0], served_name(self.model))
                max_len = await client.max_model_len()
                if self.inputs is None:
                    self.inputs = self._build_inputs(max_len)
                run = await self._answer(client, flags, reference, max_len)
        finally:
            await engines.stop()
        run.seconds = time.monotonic() - t0
        self.log(f"quality gate: {label}: done in {run.seconds:.0f} s")
        return run

    def _build_inputs(self, max_model_len: int) -> Inputs:
        tok = self.tokenizer or load_tokenizer(str(resolve_model(self.model)))
        self.tokenizer = tok
        s = self.suite
        short = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True))
                 for m in short_prompts(s)]
        return Inputs(short, long_questions(s, tok, max_model_len - s.answer_tokens - 1))

    async def _answer(self, client: _Client, flags: list[str], reference: PointRun | None,
                      max_len: int) -> PointRun:
        s, inputs = self.suite, self.inputs
        run = PointRun(list(flags), [], [], [], max_model_len=max_len)
        t0 = time.monotonic()
        self.log(f"  {len(inputs.short)} short prompts, {s.max_tokens} tokens each")
        short = await asyncio.gather(*(client.complete(ids, s.max_tokens) for ids in inputs.short))
        run.outputs = [ids for ids, _ in short]
        run.texts = [text for _, text in short]
        # the probes next, while the outputs' KV blocks are still in the prefix cache
        ref = (reference or run).outputs
        self.log(f"  top-1 probes ({sum(map(len, ref))} positions; {time.monotonic() - t0:.0f} s)")
        probes = [[client.complete(ids + out[:i], 1, probe=True) for i in range(len(out))]
                  for ids, out in zip(inputs.short, ref)]
        results = await asyncio.gather(*(asyncio.gather(*row) for row in probes))
        run.top1 = [[ids[0] if ids else -1 for ids, _ in row] for row in results]
        for context in s.contexts:       # a document's first question fills the prefix cache
            qs = [q for q in inputs.questions if q.context == context]
            if not qs:
                continue
            self.log(f"  numbers at {context} tokens ({len(qs[0].prompt_ids)} in the prompt; "
                     f"{time.monotonic() - t0:.0f} s)")
            first = await client.complete(qs[0].prompt_ids, s.answer_tokens)
            rest = await asyncio.gather(*(client.complete(q.prompt_ids, s.answer_tokens)
                                          for q in qs[1:]))
            run.answers += [text for _, text in [first, *rest]]
        run.errors = client.errors
        return run


class _Client:
    """Greedy /v1/completions on token ids; a failed request is recorded and answers empty."""

    def __init__(self, session, url: str, model: str, concurrency: int = 32):
        self.session, self.url, self.model = session, url, model
        self.errors: list[str] = []
        self.slots = asyncio.Semaphore(concurrency)     # the engine's max_num_seqs is 64

    async def max_model_len(self) -> int:
        async with self.session.get(self.url + "/v1/models") as resp:
            models = await resp.json()
        return int(models["data"][0]["max_model_len"])

    async def complete(self, prompt_ids: list[int], max_tokens: int,
                       probe: bool = False) -> tuple[list[int], str]:
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True, "ignore_eos": probe}
        async with self.slots:
            try:
                async with self.session.post(self.url + "/v1/completions", json=body) as resp:
                    obj = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: "
                                           f"{(obj.get('error') or {}).get('message')}")
            except Exception as e:  # recorded: the verdict says the point failed, and why
                self.errors.append(f"{type(e).__name__}: {e}")
                return [], ""
        choice = obj["choices"][0]
        return list(choice.get("token_ids") or []), choice.get("text") or ""


# --- the verdict -----------------------------------------------------------------------------

def first_divergence(base: list[int], cand: list[int], max_tokens: int) -> int:
    """The first position where the two outputs differ (an output that ended differs from one
    that goes on); `max_tokens` when they never do."""
    for i, (a, b) in enumerate(zip(base, cand)):
        if a != b:
            return i
    return max_tokens if len(base) == len(cand) else min(len(base), len(cand))


def compare(base: PointRun, cand: PointRun, suite: Suite, thresholds: Thresholds,
            inputs: Inputs | None = None) -> dict:
    """Every measure of `cand` against `base`, each with its threshold and pass/fail;
    `passed` when all pass and the candidate answered every request."""
    n = max(len(base.outputs), 1)
    exact = sum(a == b for a, b in zip(base.outputs, cand.outputs)) / n
    divergence = [first_divergence(a, b, suite.max_tokens)
                  for a, b in zip(base.outputs, cand.outputs)]
    median_div = statistics.median(divergence) if divergence else float(suite.max_tokens)
    agree = total = 0
    for ref, b, c in zip(base.outputs, base.top1, cand.top1):
        total += len(ref)
        agree += sum(x == y for x, y in zip(b, c))
    top1 = agree / total if total else 1.0
    questions = inputs.questions if inputs else []
    right_base = [quotes(a, q.expected) for a, q in zip(base.answers, questions)]
    right_cand = [quotes(a, q.expected) for a, q in zip(cand.answers, questions)]
    share_base = sum(right_base) / len(right_base) if right_base else 1.0
    share_cand = sum(right_cand) / len(right_cand) if right_cand else 1.0
    by_context = {}
    for q, rb, rc in zip(questions, right_base, right_cand):
        row = by_context.setdefault(str(q.context), {"prompt_tokens": len(q.prompt_ids),
                                                     "questions": 0, "baseline": 0,
                                                     "candidate": 0})
        row["questions"] += 1
        row["baseline"] += rb
        row["candidate"] += rc
    t = thresholds
    div_bar = t.first_divergence * suite.max_tokens
    metrics = {
        "exact_match": _metric(exact, t.exact_match),
        "first_divergence_median": _metric(median_div, div_bar if div_bar else None),
        "top1_agreement": _metric(top1, t.top1_agreement),
        "numbers_quoted": {**_metric(share_cand, max(share_base - t.numbers_drop, 0.0)),
                           "baseline": share_base},
    }
    passed = all(m["passed"] for m in metrics.values()) and not cand.errors
    return {"baseline_flags": base.flags, "candidate_flags": cand.flags, "passed": passed,
            "metrics": metrics, "numbers_by_context": by_context,
            "thresholds": dataclasses.asdict(thresholds), "errors": cand.errors[:5],
            "seconds": {"baseline": round(base.seconds, 1), "candidate": round(cand.seconds, 1)},
            "first_divergence": divergence,
            "answers": [{"context": q.context, "depth": q.depth, "expected": q.expected,
                         "baseline": a, "candidate": b}
                        for q, a, b in zip(questions, base.answers, cand.answers)],
            "outputs": [{"baseline": a, "candidate": b}
                        for a, b in zip(base.texts, cand.texts)]}


def _metric(value: float, bar: float | None) -> dict:
    return {"value": value, "threshold": bar, "passed": bar is None or value >= bar - 1e-9}


async def run_gate(model: str, baseline_flags: list[str], candidate_flags: list[str], *,
                   suite: Suite = Suite(), thresholds: Thresholds = Thresholds(),
                   threads: int | None = None, launcher=None) -> dict:
    """One candidate against the baseline, from scratch (a tuner checking several points keeps
    one `Gate` so the baseline runs once)."""
    gate = Gate(model, baseline_flags, suite=suite, thresholds=thresholds, threads=threads,
                launcher=launcher)
    return await gate.check(candidate_flags)


# --- `prefixgate bench --scenario quality` ----------------------------------------------------

def run_quality(args) -> int:
    """The gate from the command line: exit status 0 when every candidate passes, 1 when one
    does not (or an engine failed), 2 for a bad spec, threshold or model."""
    try:
        candidates = parse_candidates(args.candidate or [])
        points = [(spec, flags_from_spec(spec)) for spec in candidates]
        baseline = flags_from_spec(args.baseline or "")
        thresholds = parse_thresholds(args.gate or "")
        suite = target.given(Suite(), prompts=args.requests, max_tokens=args.max_tokens,
                             seed=args.seed,
                             contexts=tuple(args.contexts) if args.contexts else None)
    except ValueError as e:
        print(f"prefixgate bench: {e}", file=sys.stderr)
        return 2
    if getattr(args, "self_check", False):
        points.insert(0, ("baseline (self-check)", baseline))
    if not points:
        print("prefixgate bench: --scenario quality needs --candidate SPEC (e.g. "
              "kv_cache_dtype=fp8) or --self-check", file=sys.stderr)
        return 2
    model = target.scenario_model(args)
    try:
        tokenizer = load_tokenizer(str(resolve_model(model)))
    except (OSError, ValueError) as e:
        print(f"prefixgate bench: cannot run the scenario on {model}: {e}", file=sys.stderr)
        return 2
    gate = Gate(model, baseline, suite=suite, thresholds=thresholds, timeout=args.timeout,
                tokenizer=tokenizer)
    t0 = time.monotonic()
    try:
        verdicts = asyncio.run(_check_all(gate, points))
    except RuntimeError as e:
        print(f"prefixgate bench: {e}", file=sys.stderr)
        return 1
    archive = {"schema": archive_mod.SCHEMA, "kind": "quality",
               "config": {"scenario": "quality", "model": model, "baseline": baseline,
                          "candidates": [spec for spec, _ in points],
                          "suite": dataclasses.asdict(gate.suite),
                          "thresholds": dataclasses.asdict(thresholds),
                          "engine_args": ENGINE_ARGS, "threads": gate.threads},
               "environment": archive_mod.environment(),
               "baseline": {"flags": baseline, "seconds": round(gate.baseline.seconds, 1),
                            "max_model_len": gate.baseline.max_model_len},
               "verdicts": verdicts, "seconds": round(time.monotonic() - t0, 1), "cells": []}
    print_quality(archive)
    archive_mod.save_outputs(archive, args.out, None)
    return 0 if all(v["passed"] for v in verdicts) else 1


async def _check_all(gate: Gate, points: list[tuple[str, list[str]]]) -> list[dict]:
    await gate.run_baseline()           # its failure ends the run: there is nothing to compare
    verdicts = []
    for spec, flags in points:
        try:
            verdict = await gate.check(flags)
        except RuntimeError as e:       # this candidate's engine would not start
            verdict = {"candidate_flags": flags, "passed": False, "metrics": {},
                       "errors": [str(e)]}
        verdicts.append({"spec": spec, **verdict})
    return verdicts


def print_quality(archive: dict) -> None:
    """The table: a row per measure, a column per candidate, each value with ok / FAIL."""
    cfg, verdicts = archive["config"], archive["verdicts"]
    s = cfg["suite"]
    base = " ".join(cfg["baseline"]) or "the engine's defaults"
    print(f"\nquality gate: {cfg['model']}, baseline {base}; {s['prompts']} prompts x "
          f"{s['max_tokens']} greedy tokens; numbers: {s['questions']} questions at each of "
          f"{', '.join(map(str, s['contexts'])) or 'no'} tokens of context")
    rows = [["metric", "threshold", *(v["spec"] for v in verdicts)]]
    for title, key, form in (("exact match", "exact_match", "{:.2f}"),
                             ("first divergence, median", "first_divergence_median", "{:.1f}"),
                             ("top-1 agreement", "top1_agreement", "{:.3f}"),
                             ("numbers quoted", "numbers_quoted", "{:.2f}")):
        ms = [v["metrics"].get(key) for v in verdicts]
        bar = next((m["threshold"] for m in ms if m), None)
        rows.append([title, "-" if bar is None else ">= " + form.format(bar)]
                    + ["-" if m is None else form.format(m["value"]) + (
                        "" if m["threshold"] is None else " ok" if m["passed"] else " FAIL")
                       for m in ms])
    rows.append(["  the baseline's", ""] + [
        f"{v['metrics']['numbers_quoted']['baseline']:.2f}" if v["metrics"] else "-"
        for v in verdicts])
    contexts = {c: r["prompt_tokens"] for v in verdicts
                for c, r in v.get("numbers_by_context", {}).items()}
    for context, tokens in contexts.items():
        cells = [v.get("numbers_by_context", {}).get(context) for v in verdicts]
        rows.append([f"  at {context} ({tokens} tok)", "candidate/base"]
                    + ["-" if r is None else f"{r['candidate']}/{r['questions']} vs "
                       f"{r['baseline']}/{r['questions']}" for r in cells])
    rows.append(["engine time, s", f"base {archive['baseline']['seconds']:.0f}"]
                + [f"{v['seconds']['candidate']:.0f}" if "seconds" in v else "-"
                   for v in verdicts])
    rows.append(["verdict", ""] + ["PASS" if v["passed"] else "FAIL" for v in verdicts])
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print(row[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(row[1:], widths[1:])))
        if n == 0:
            print("-" * sum(widths))
    for v in verdicts:
        if v.get("errors"):
            print(f"{v['spec']}: {len(v['errors'])} errors, first: {v['errors'][0]}",
                  file=sys.stderr)
        failed = [k for k, m in v["metrics"].items() if not m["passed"]] or ["engine errors"]
        print(f"{v['spec']}: " + ("passes the gate" if v["passed"] else
                                  "reported, not recommended: below the gate on "
                                  + ", ".join(failed)))
    print(f"wall time {archive['seconds']:.0f} s")
