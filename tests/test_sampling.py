"""Sampler properties: filters never let a forbidden token through, seeds reproduce, stop strings
cut exactly where they first appear however the text is streamed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.sampling import (
    Sampler,
    SamplingParams,
    StopStringMatcher,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    filter_logits,
    sample_batch,
)

FAST = settings(max_examples=60, deadline=None)


def _logits(seed: int, vocab: int = 50, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_k": -2}, {"top_k": 1.5}, {"top_p": 0.0}, {"top_p": 1.2}, {"min_p": -0.1}, {"min_p": 2},
    {"max_tokens": 0}, {"max_tokens": 2.0}, {"seed": -1}, {"seed": "x"}, {"stop": [""]},
])
def test_nonsense_values_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ("END",)


def test_greedy_is_argmax():
    logits = _logits(0, rows=4)
    assert torch.equal(Sampler(SamplingParams(temperature=0))(logits), logits.argmax(-1))


@FAST
@given(seed=st.integers(0, 10_000), k=st.integers(1, 50))
def test_top_k_never_emits_outside_the_top_k(seed, k):
    logits = _logits(seed)
    top = set(torch.topk(logits[0], k).indices.tolist())
    assert torch.isfinite(apply_top_k(logits, k)).sum().item() == k  # no ties in random floats
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=k, seed=seed))
    draws = sampler(logits.expand(200, -1)).tolist()
    assert set(draws) <= top


@FAST
@given(seed=st.integers(0, 10_000), p=st.floats(0.01, 0.99))
def test_top_p_keeps_the_smallest_nucleus(seed, p):
    logits = _logits(seed)
    kept = torch.isfinite(apply_top_p(logits, p))[0]
    probs = logits.softmax(-1)[0]
    kept_probs = probs[kept].sort(descending=True).values
    assert kept_probs.sum().item() >= p - 1e-6  # reaches p ...
    assert kept_probs[:-1].sum().item() < p + 1e-6  # ... and is minimal
    assert probs[~kept].max().item() <= kept_probs[-1].item() if (~kept).any() else True
    draws = Sampler(SamplingParams(top_p=p, seed=seed))(logits.expand(200, -1))
    assert kept[draws].all()


@FAST
@given(seed=st.integers(0, 10_000), p=st.floats(0.0, 1.0))
def test_min_p_drops_tokens_below_the_threshold(seed, p):
    logits = _logits(seed)
    kept = torch.isfinite(apply_min_p(logits, p))[0]
    probs = logits.softmax(-1)[0]
    assert torch.equal(kept, probs >= p * probs.max()) or p == 0.0
    assert kept[probs.argmax()]


def test_seed_reproduces_and_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: 20 equal draws by chance are impossible in practice
    def draws(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [int(s(logits)[0]) for _ in range(20)]
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = Sampler(SamplingParams(temperature=0.5, seed=0))
    counts = torch.bincount(sampler(logits.expand(20_000, -1)), minlength=4).float() / 20_000
    expected = (logits[0] / 0.5).softmax(-1)
    torch.testing.assert_close(counts, expected, atol=0.015, rtol=0)


def test_filters_compose():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    s = Sampler(SamplingParams(top_k=4, top_p=0.8, min_p=0.35))
    kept = torch.isfinite(s.filtered_logits(logits))[0].tolist()
    assert kept == [True, True, False, False, False]  # top-p keeps 3, min-p (0.175) drops 0.15


# --- stop strings ---------------------------------------------------------------------------

def _stream(text: str, cuts: list[int], stops: tuple[str, ...]) -> tuple[list[str], StopStringMatcher]:
    pieces, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[prev:c])
        prev = c
    m = StopStringMatcher(stops)
    out = [m.feed(p) for p in pieces]
    out.append(m.flush())
    return out, m


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1,
       max_size=4), min_size=1, max_size=3), data=st.data())
def test_stop_strings_cut_where_the_first_stop_completes(text, stops, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    out, m = _stream(text, cuts, tuple(stops))
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    expected = text[: min(hits)[1]] if hits else text  # the stop that completes first
    assert "".join(out) == expected
    assert m.stopped == bool(hits)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab", max_size=20), stop=st.text(alphabet="ab", min_size=1, max_size=4))
def test_stop_strings_never_show_text_past_the_stop(text, stop):
    """Streamed one character at a time, what is shown is always a prefix of the final text."""
    m = StopStringMatcher((stop,))
    shown = ""
    final = text[: text.find(stop)] if stop in text else text
    for ch in text:
        shown += m.feed(ch)
        assert final.startswith(shown)
    shown += m.flush()
    assert shown == final


def test_stop_string_spanning_pieces():
    """A possible start of the stop string ("d", "d.") is held back until it is decided."""
    out, m = _stream("Hello world. Next", [3, 8, 11, 12], ("d. N",))
    assert out == ["Hel", "lo wo", "rl", "", "", ""] and m.stopped
    out, m = _stream("Hello world. Next", [3, 8, 11, 12], ("d. X",))
    assert out == ["Hel", "lo wo", "rl", "", "d. Next", ""] and not m.stopped


# --- the engine's batched sampling ----------------------------------------------------------

BATCH = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
         SamplingParams(temperature=0.7, top_k=40, seed=2), SamplingParams(temperature=1.0, top_p=0.9, seed=3),
         SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.05, seed=4),
         SamplingParams(temperature=1.3, top_k=5, seed=5), SamplingParams(temperature=0.5, min_p=0.2, seed=6)]


@pytest.mark.parametrize("vocab", [64, 50_000])  # one chunk; several chunks of rows
def test_batched_sampling_draws_what_each_request_draws_alone(vocab):
    alone = [Sampler(p) for p in BATCH]
    batched = [Sampler(p) for p in BATCH]
    for step in range(5):
        logits = _logits(step, vocab, rows=len(BATCH)).to(torch.bfloat16)
        expected = [int(s(logits[i:i + 1])[0]) for i, s in enumerate(alone)]
        assert sample_batch(logits, batched) == expected


def test_per_row_filter_parameters_equal_one_row_at_a_time():
    logits = _logits(3, 200, rows=4)
    ks, ps, mins, temps = [0, 7, 50, 7], [1.0, 0.9, 0.5, 0.3], [0.0, 0.1, 0.0, 0.02], [1.0, 0.7, 1.3, 2.0]
    together = filter_logits(logits, temps, ks, ps, mins)
    for i in range(4):
        assert torch.equal(together[i:i + 1], filter_logits(logits[i:i + 1], temps[i], ks[i], ps[i], mins[i]))


def test_a_row_that_cannot_be_drawn_fails_alone():
    logits = _logits(4, 50, rows=3)
    logits[1] = float("nan")
    tokens = sample_batch(logits, [Sampler(SamplingParams(seed=i)) for i in range(3)])
    assert isinstance(tokens[1], RuntimeError)
    assert [type(t) for t in (tokens[0], tokens[2])] == [int, int]
