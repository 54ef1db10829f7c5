"""Long-context retrieval tasks of the RULER kind (arXiv 2404.06654), generated from any text.

Each sample is a haystack of about ``context`` tokens cut from the text, facts hidden in it at
chosen depths, and a question whose answers are known, so a model's output can be checked.
Nothing is downloaded: the facts are drawn from a seeded generator and the haystack is whatever
text is given (by default the one ``kvlab evict`` ships).

The prompt has RULER's form, which is what makes a small model answer at all (the bare pass-key
prompt it replaced found the key in 25% of trials on SmolLM2 with the whole cache, this form in
100%): the instruction comes first, so the model reads the haystack knowing what to look for;
each fact is one short sentence naming a key and its value; the question names the key; the
answer is started for the model ("The ... is"), so the first generated tokens are the value. An
instruction-tuned checkpoint gets the whole message through its own chat template, the answer's
start after the assistant's turn opens; a checkpoint without a template gets the plain text.

Tasks (``TASKS``):

- ``niah_single``: one number for one key.
- ``niah_multikey``: four keys with a number each; the question asks for one (the others are
  distractors of the same form).
- ``niah_multivalue``: one key with four numbers scattered through the text; all four asked.
- ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of five
  variables spread through the text; the question asks for every variable that holds the number.
- ``qa``: a question about the text itself: a passage to be quoted word for word from its first six
  words (taken from a sentence at the chosen depth, and found only there); the answer's start
  repeats them, so the next word generated must be the text's next word.

A sample's score is the fraction of its answers found in the output (RULER's ``string_match_all``:
case-insensitive, as whole words; ``qa``'s must be the first word): 0 or 1 for the one-answer tasks.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kvlab.models.chat import DEFAULT_TEMPLATE, ChatTemplate
from kvlab.models.tokenizer import TextTokenizer

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "qa")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where a one-fact task hides its fact, trial after trial
# answer tokens each task generates: its answers, with room for the words around them
ANSWER_TOKENS = {"niah_single": 12, "niah_multikey": 12, "niah_multivalue": 48, "vt": 40, "qa": 8}
KEYS = ("tulip", "harbour", "violin", "lantern", "walnut", "comet", "saddle", "meadow", "falcon",
        "ribbon", "quarry", "thimble", "orchard", "anchor", "glacier", "pepper", "compass", "marble",
        "beacon", "willow")
NUM_KEYS = 4  # niah_multikey's keys, niah_multivalue's values
CHAIN = 5  # vt's variables


@dataclass(frozen=True)
class Sample:
    """One trial: the prompt's text (chat-templated where the model has a template) and the
    strings a right answer contains."""

    task: str
    prompt: str
    answers: tuple[str, ...]
    depth: float  # where its (first) fact sits, as a fraction of the haystack
    leading: bool = False  # the answer must be the output's first word (a continuation)

    def score(self, output: str) -> float:
        """The fraction of the answers found in ``output`` (its first word, if ``leading``)."""
        text = output.lower()
        if self.leading:
            first = re.findall(r"[\w']+", text)[:1]
            return float(first == [self.answers[0].lower()])
        found = sum(bool(re.search(rf"(?<![\w]){re.escape(a.lower())}(?![\w])", text)) for a in self.answers)
        return found / len(self.answers)


@dataclass(frozen=True)
class _Form:
    instruction: str
    facts: list[str]
    question: str
    answer_start: str
    answers: tuple[str, ...]


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _niah(task: str, rng: random.Random) -> _Form:
    intro = ("Special magic numbers are hidden in the text below, each stated once for a key. "
             "Memorise them: you will be asked about them after the text.")
    keys = rng.sample(KEYS, NUM_KEYS)
    if task == "niah_multivalue":
        key, values = keys[0], [_number(rng) for _ in range(NUM_KEYS)]
        return _Form(intro, [f"One of the special magic numbers for {key} is: {v}." for v in values],
                     f"What are all the special magic numbers for {key} in the text above?",
                     f"The special magic numbers for {key} in the text above are", tuple(values))
    values = [_number(rng) for _ in keys]
    facts = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
    if task == "niah_single":
        facts = facts[:1]
    # the first fact is asked (the keys are in random order): it sits at the trial's depth
    return _Form(intro, facts, f"What is the special magic number for {keys[0]} in the text above?",
                 f"The special magic number for {keys[0]} in the text above is", (values[0],))


def _vt(rng: random.Random) -> _Form:
    names = []
    while len(names) < CHAIN:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    facts = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    return _Form("Memorise and follow the chain of variable assignments hidden in the text below.", facts,
                 f"Which variables are assigned the value {value} in the text above?",
                 f"Following the assignments in the text above, the variables assigned the value {value} are",
                 tuple(names))


def _sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the text's sentences."""
    return [(m.start(), m.end()) for m in re.finditer(r"[^.!?]+[.!?]", text)]


def _qa_form(quote: str, answer: str) -> _Form:
    return _Form("Read the text below carefully: you will be asked to quote a passage of it word for word.", [],
                 f'Quote the passage of the text above that begins "{quote}", word for word.',
                 f"The passage reads: {quote}", (answer,))


def _qa(body: str, depth: float) -> _Form | None:
    """Six words quoted from a sentence near ``depth``, the seventh (of 4+ letters) asked: seven
    plain words in a row (no punctuation between them, so the seventh is the very next word)
    that occur only there; None if no sentence of the body has them."""
    spans = _sentences(body)
    start = int(depth * len(spans))
    for s, e in spans[start:] + spans[:start][::-1]:
        words = body[s:e].split(" ")
        for i in range(len(words) - 6):
            run = words[i:i + 7]
            if all(w.isalpha() for w in run) and len(run[6]) >= 4 and body.count(" ".join(run)) == 1:
                return _qa_form(" ".join(run[:6]), run[6])
    return None


def _insert(body: str, facts: list[str], depths: list[float]) -> str:
    """``facts`` put into ``body`` at the sentence end nearest each of ``depths`` (fractions of its characters)."""
    ends = [0] + [e for _, e in _sentences(body)] + [len(body)]
    cuts = sorted((min(ends, key=lambda e: abs(e - d * len(body))), i) for i, d in enumerate(depths))
    out, last = [], 0
    for at, i in cuts:
        out += [body[last:at], " ", facts[i]]
        last = at
    return "".join(out + [body[last:]])


class Suite:
    """Samples of about ``context`` tokens from ``text``, seeded: the same arguments give the same
    samples on every machine."""

    def __init__(self, tokenizer: TextTokenizer, text: str, context: int, chat: ChatTemplate | None = None,
                 seed: int = 0) -> None:
        self.tokenizer, self.context, self.seed = tokenizer, context, seed
        self.chat = chat if chat is not None and chat.source != DEFAULT_TEMPLATE else None
        self.ids = tokenizer.encode(text)
        if len(self.ids) < context:
            raise ValueError(f"the text has {len(self.ids)} tokens, fewer than --context {context}")

    def _wrap(self, form: _Form, haystack: str) -> str:
        message = f"{form.instruction}\n\n{haystack}\n\n{form.question}"
        if self.chat is None:
            return f"{message}\n\nAnswer: {form.answer_start}"
        turn = self.chat.render([{"role": "user", "content": message}])
        return turn + ("" if turn[-1:].isspace() else " ") + form.answer_start

    def samples(self, task: str, trials: int) -> list[Sample]:
        """``trials`` samples of ``task``; trial t's (first) fact at DEPTHS[t % 5]."""
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose {', '.join(TASKS)}")
        rng = random.Random(f"{self.seed}:{task}")
        return [self._sample(task, t, rng) for t in range(trials)]

    def _sample(self, task: str, trial: int, rng: random.Random) -> Sample:
        depth = DEPTHS[trial % len(DEPTHS)]
        form = _vt(rng) if task == "vt" else None if task == "qa" else _niah(task, rng)
        # the haystack fills what the instruction, facts, question and template leave
        probe = form or _qa_form(" ".join(["word"] * 6), "word")
        overhead = len(self.tokenizer.encode(self._wrap(probe, " ".join(probe.facts))))
        room = self.context - overhead
        if room < 64:
            raise ValueError(f"--context {self.context} leaves {room} tokens of text around the "
                             f"{task} question: use at least {overhead + 64}")
        offset = rng.randrange(0, len(self.ids) - room + 1)
        body = self.tokenizer.decode(self.ids[offset:offset + room])
        body = body[body.find(" ") + 1:] if offset else body  # start at a word, not inside one
        if form is None:
            form = _qa(body, depth)
            if form is None:
                raise ValueError("the text has no sentence with a quote that occurs only once: "
                                 "give a longer or less repetitive --text")
        if task == "niah_single" or task == "qa":
            depths = [depth]
        elif task == "vt":  # the chain in order, from the trial's depth to the end
            depths = [depth + (1 - depth) * i / CHAIN for i in range(CHAIN)]
        else:
            depths = [depth] + [rng.random() for _ in form.facts[1:]]
        haystack = _insert(body, form.facts, depths) if form.facts else body
        return Sample(task, self._wrap(form, haystack), form.answers, depth, leading=task == "qa")


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (for fractional scores, of their sum as if
    it were a count: exact for the one-answer tasks, a close approximation for the others)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
