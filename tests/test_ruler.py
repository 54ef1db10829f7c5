"""The RULER-style retrieval tasks: seeded, checkable, at the length asked, their facts where said."""

import re

import pytest

from kvlab.data import PERSUASION
from kvlab.models import load
from kvlab.ruler import TASKS, Suite, wilson

TEXT = open(PERSUASION).read()


@pytest.fixture(scope="module")
def smollm():
    return load("smollm2-135m", "fp32")


def _body(prompt: str) -> str:
    """The haystack: between the instruction and the question."""
    return re.split(r"\n\n(?=What |Which |Quote )", prompt.split("\n\n", 1)[1])[0]


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_seeded_sized_and_hold_their_answers(smollm, task):
    suite = Suite(smollm.tokenizer, TEXT, 1024, smollm.chat_template)
    samples = suite.samples(task, 6)
    assert samples == Suite(smollm.tokenizer, TEXT, 1024, smollm.chat_template).samples(task, 6)
    assert samples != Suite(smollm.tokenizer, TEXT, 1024, smollm.chat_template, seed=1).samples(task, 6)
    for s in samples:
        assert abs(len(smollm.tokenizer.encode(s.prompt)) - 1024) <= 4
        assert s.prompt.startswith("<|im_start|>")  # SmolLM2's own chat template
        for a in s.answers:
            assert a in s.prompt
        assert s.score(" ".join(s.answers)) == 1.0 and s.score("nothing of the kind") == 0.0
    assert [s.depth for s in samples] == [0.1, 0.3, 0.5, 0.7, 0.9, 0.1]


def test_a_needle_sits_at_its_depth_and_the_question_names_its_key(smollm):
    for s in Suite(smollm.tokenizer, TEXT, 2048, smollm.chat_template).samples("niah_single", 5):
        body = _body(s.prompt)
        fact = re.search(r"The special magic number for (\w+) is: (\d+)\.", body)
        assert fact.group(2) == s.answers[0]
        assert f"special magic number for {fact.group(1)} in the text above?" in s.prompt
        assert abs(fact.start() / len(body) - s.depth) < 0.1  # at the nearest sentence end (Austen writes long ones)


def test_multikey_has_distractors_and_multivalue_asks_every_value(smollm):
    suite = Suite(smollm.tokenizer, TEXT, 1024)
    for s in suite.samples("niah_multikey", 3):
        numbers = re.findall(r"The special magic number for (\w+) is: (\d+)\.", s.prompt)
        assert len({k for k, _ in numbers}) == 4 and s.answers[0] in dict(numbers).values()
        assert s.score(" ".join(v for _, v in numbers if v != s.answers[0])) == 0.0  # a distractor is wrong
    s = suite.samples("niah_multivalue", 1)[0]
    assert len(s.answers) == 4 and s.score(f"{s.answers[0]} and {s.answers[2]}") == 0.5


def test_variable_chain_is_in_order_and_reaches_the_value(smollm):
    s = Suite(smollm.tokenizer, TEXT, 1024).samples("vt", 3)[2]
    chain = re.findall(r"VAR (\w+) = (?:VAR )?(\w+)\.", s.prompt)
    assert [a for a, _ in chain] == list(s.answers)
    value = re.search(r"assigned the value (\d+) in the text above", s.prompt).group(1)
    assert chain[0][1] == value and all(b == a for (a, _), (_, b) in zip(chain, chain[1:]))


def test_qa_asks_the_word_after_a_quote_found_once(smollm):
    """Without a chat template, the plain text ends in the answer's start."""
    demo = load("austen-demo", "fp32")
    for s in Suite(demo.tokenizer, TEXT, 512).samples("qa", 5):
        quote = re.search(r'begins "([^"]+)"', s.prompt).group(1)
        body = _body(s.prompt)
        assert body.count(quote) == 1 and body.count(f"{quote} {s.answers[0]}") == 1
        assert s.prompt.endswith(f"Answer: The passage reads: {quote}")
        assert s.score(f" {s.answers[0]} and so on") == 1.0
        assert s.score(f", and then {s.answers[0]}") == 0.0  # the first word only


def test_a_context_too_short_for_the_question_is_one_line():
    demo = load("austen-demo", "fp32")
    with pytest.raises(ValueError, match="use at least"):
        Suite(demo.tokenizer, TEXT, 80).samples("vt", 1)


def test_wilson_interval():
    assert wilson(0, 20)[0] == 0.0 and wilson(0, 20)[1] == pytest.approx(0.1611, abs=1e-4)
    assert wilson(10, 20) == pytest.approx((0.2993, 0.7007), abs=1e-4)
    assert wilson(20, 20)[1] == 1.0
