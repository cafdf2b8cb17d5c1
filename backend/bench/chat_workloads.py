"""The speculative benchmark's workloads on a real model: chat requests rendered through the
model's own chat template, as a server would render them.

  rag   a retrieval-augmented answer: a system prompt with numbered documents (paragraphs of
        the English text in backend/data) and a question about one of them that asks for its
        sentences word for word, so the answer quotes its prompt as a RAG answer citing its
        sources does
  chat  free chat: a short writing or explaining task with nothing to quote

Prompts are drawn reproducibly from `seed`, each different from the others.
"""
from __future__ import annotations

import random

DOCUMENTS = 3                     # per RAG prompt
MIN_PARAGRAPH_WORDS = 40          # headings and one-line questions are no documents
RAG_SYSTEM = ("Answer the user's question using only the documents below. Quote the "
              "sentences you rely on word for word, in quotation marks.")
RAG_QUESTIONS = (
    'What does document {n} say, from "{start}" on? Quote it in full.',
    'Quote document {n}, which begins "{start}", word for word.',
    'Which sentences of document {n} follow "{start}"? Answer with all of them, exactly.',
)
CHAT_TASKS = (
    "Write a short story about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Give me three fun facts about {topic}.",
    "Write a poem about {topic}.",
    "What would a day in the life of {topic} look like?",
    "Describe {topic} in a few sentences.",
)
CHAT_TOPICS = ("a lighthouse keeper", "the moon", "a lost umbrella", "honey bees", "volcanoes",
               "a robot learning to cook", "the ocean at night", "an old library",
               "a friendly dragon", "autumn leaves", "a train journey", "a city garden")


def documents() -> list[str]:
    """Sections of the English text in the package data (backend/data): two paragraphs each,
    long enough that quoting one fills a request's tokens."""
    from prefixgate.backend.demo import corpus_texts

    out = []
    for text in corpus_texts():
        paragraphs = [p.strip() for p in text.split("\n\n")
                      if p.isascii() and len(p.split()) >= MIN_PARAGRAPH_WORDS]
        out += ["\n\n".join(paragraphs[i:i + 2]) for i in range(0, len(paragraphs) - 1, 2)]
    return out


def rag_messages(rng: random.Random, docs: list[str]) -> list[dict]:
    chosen = rng.sample(docs, DOCUMENTS)
    n = rng.randrange(DOCUMENTS)
    start = " ".join(chosen[n].split()[:rng.randint(4, 7)])
    listed = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
    question = rng.choice(RAG_QUESTIONS).format(n=n + 1, start=start)
    return [{"role": "system", "content": f"{RAG_SYSTEM}\n\n{listed}"},
            {"role": "user", "content": question}]


def chat_messages(rng: random.Random) -> list[dict]:
    task = rng.choice(CHAT_TASKS).format(topic=rng.choice(CHAT_TOPICS))
    return [{"role": "user", "content": task}]


def chat_prompts(tokenizer, kind: str, n: int, seed: int) -> list[list[int]]:
    """`n` different prompts of `kind` (rag or chat) as token ids, rendered with the chat
    template (generation prompt added) and encoded as the server encodes a chat request."""
    rng = random.Random(f"{seed}:{kind}")
    docs = documents() if kind == "rag" else []
    seen, out = set(), []
    for _ in range(100 * n):                # the chat combinations run out well past any batch
        if len(out) == n:
            break
        messages = rag_messages(rng, docs) if kind == "rag" else chat_messages(rng)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if text not in seen:
            seen.add(text)
            out.append(tokenizer.encode(text, add_special_tokens=False))
    return out
