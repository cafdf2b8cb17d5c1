"""What every engine of a quality gate (proxy/bench/quality.py) is asked, the same for all:
built once per gate, from `Suite.seed`.

  short set   `Suite.prompts` varied chat prompts (a task about a topic), `Suite.max_tokens`
              greedy tokens each.
  numbers     built-in documents (ledgers of invoices, crates, accounts, weights with numbers,
              between plain sentences without any digit), one per `Suite.contexts` length in
              tokens of the model's tokenizer (capped at the model's context); each followed by
              `Suite.questions` questions about facts near its start and middle. An answer is
              right when it quotes the fact's number (`quotes`: commas and a currency sign
              aside).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Needle:
    """A kind of fact asked about, one of each kind per document: its sentence and question
    ({name}: whom it is about; {value}: its number; {date}: a day and a month, drawn when the
    sentence is written) and how its number is drawn and written."""
    statement: str
    question: str
    whole: range                                # the number's integer part
    grouped: bool = False                       # with thousands commas
    fraction: tuple[tuple[int, int], int] | None = None   # decimals: ((start, stop), digits)

    def value(self, rng: random.Random) -> str:
        whole = rng.randrange(self.whole.start, self.whole.stop)
        text = f"{whole:,}" if self.grouped else str(whole)
        if self.fraction:
            (start, stop), digits = self.fraction
            text += f".{rng.randrange(start, stop):0{digits}d}"
        return text

    def sentence(self, name: str, value: str, rng: random.Random) -> str:
        date = (f"{rng.randrange(1, 29)} {rng.choice(MONTHS)}" if "{date}" in self.statement
                else "")
        return self.statement.format(name=name, value=value, date=date)


NEEDLES = (
    Needle("The invoice from {name} was paid on {date} for {value} dollars.",
           "For how many dollars was the invoice from {name} paid?",
           range(1000, 99999), grouped=True, fraction=((0, 100), 2)),
    Needle("The warehouse run by {name} holds {value} crates of spare parts.",
           "How many crates does the warehouse run by {name} hold?", range(120, 9999), True),
    Needle("The bank account of {name} has the number {value}.",
           "What is the bank account number of {name}?", range(1_000_000, 99_999_999)),
    Needle("The last shipment for {name} weighed {value} kilograms.",
           "How many kilograms did the last shipment for {name} weigh?",
           range(100, 9999), grouped=True, fraction=((0, 10), 1)),
    Needle("The lease signed by {name} runs for {value} months.",
           "For how many months does the lease signed by {name} run?", range(13, 240)),
    Needle("The loan taken by {name} carries interest of {value} percent.",
           "What interest rate, in percent, does the loan taken by {name} carry?",
           range(1, 19), fraction=((1, 100), 2)),
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
    needles = [(kind, name, kind.value(rng)) for kind, name in zip(NEEDLES, names)]
    head = "Records of the Eastbrook trading office.\n\n"
    tail = "\n\nQuestion: {} Answer with the number only."

    def render(sentences: list[str], question: str) -> list[int]:
        paragraphs = [" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5)]
        text = head + "\n\n".join(paragraphs) + tail.format(question)
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True))
    questions = [kind.question.format(name=name) for kind, name, _ in needles[:suite.questions]]
    longest = max(questions, key=lambda q: len(tok.encode(q)))
    room = budget - len(render([], longest))
    sentences: list[str] = []
    used = 0
    for kind, name, value in needles[:suite.questions]:
        sentence = kind.sentence(name, value, rng)
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


@dataclass
class Inputs:
    """The prompts, as token ids, that every engine of a gate is sent."""
    short: list[list[int]]
    questions: list[Question]

