"""The output processor: stop ids, EOS, stop strings across token boundaries, length, streamed
text; and the plain loop and the paged engine, which both use it, ending requests alike."""

from __future__ import annotations

import pytest

from kvlab.engine.engine import LLMEngine
from kvlab.engine.output import OutputProcessor
from kvlab.generate import Generation
from kvlab.models.tokenizer import ByteTokenizer
from kvlab.sampling import SamplingParams
from tests.test_server_fixtures import tiny_bridge

EOS = 300


class Pieces:
    """Token i decodes to PIECES[i]: tokens that are whole strings, cut where a test wants."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError  # the processor only decodes

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def feed(out: OutputProcessor, tokens: list[int]) -> list[str]:
    """The deltas of feeding `tokens` until the processor finishes (it must)."""
    deltas = []
    for t in tokens:
        deltas.append(out.add(t))
        if out.finished:
            return deltas
    raise AssertionError("the processor did not finish")


def test_stop_string_spanning_tokens_is_held_back_then_cut():
    tok = Pieces(["he", "llo E", "N", "D and more", "x"])
    out = OutputProcessor(SamplingParams(stop=("END",), max_tokens=10), [], (), tok)
    assert feed(out, [0, 1, 2, 3]) == ["he", "llo ", "", ""]  # "E", "EN" held: maybe "END"
    assert (out.text, out.finish_reason, out.num_tokens) == ("hello ", "stop", 4)


def test_a_false_start_of_a_stop_string_is_released():
    tok = Pieces(["a E", "N", "x", "y"])
    out = OutputProcessor(SamplingParams(stop=("END",), max_tokens=4), [], (), tok)
    assert feed(out, [0, 1, 2, 3]) == ["a ", "", "ENx", "y"]
    assert (out.text, out.finish_reason) == ("a ENxy", "length")


def test_length_releases_what_was_held_back():
    """At max_tokens a possible stop-string start and a half character both come out."""
    tok = ByteTokenizer(512)
    out = OutputProcessor(SamplingParams(stop=("ok!",), max_tokens=3), [], (), tok)
    ids = tok.encode("aok")
    assert feed(out, ids) == ["a", "", "ok"]
    half = tok.encode("é")[:1]
    out = OutputProcessor(SamplingParams(max_tokens=1), [], (), tok)
    assert feed(out, half) == [tok.decode(half)] and out.finish_reason == "length"


def test_stop_token_ids_end_without_text_but_count():
    tok = ByteTokenizer(512)
    params = SamplingParams(stop_token_ids=(ord("!"),), stop=("zz",), max_tokens=10)
    out = OutputProcessor(params, [], (), tok)
    assert feed(out, tok.encode("hi z!")) == ["h", "i", " ", "", "z"]  # the held "z" released
    assert (out.text, out.finish_reason, out.num_tokens) == ("hi z", "stop", 5)


def test_eos_stops_unless_ignored():
    tok = ByteTokenizer(512)
    out = OutputProcessor(SamplingParams(max_tokens=10), [], (EOS,), tok)
    assert feed(out, [ord("a"), EOS]) == ["a", ""] and out.finish_reason == "stop"
    out = OutputProcessor(SamplingParams(max_tokens=3, ignore_eos=True), [], (EOS,), tok)
    assert feed(out, [ord("a"), EOS, ord("b")]) == ["a", f"<{EOS}>", "b"]
    assert out.finish_reason == "length"


def test_max_new_tokens_caps_below_max_tokens():
    """The engine's limit when the context ends before max_tokens."""
    out = OutputProcessor(SamplingParams(max_tokens=10), [1, 2], (), None, max_new_tokens=2)
    assert feed(out, [5, 6]) == ["", ""] and (out.text, out.finish_reason) == ("", "length")


def test_stop_strings_without_a_tokenizer_are_refused():
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        OutputProcessor(SamplingParams(stop=("x",)), [1], (), None)


def test_no_token_after_the_end():
    out = OutputProcessor(SamplingParams(max_tokens=1), [], (), None)
    out.add(1)
    with pytest.raises(RuntimeError):
        out.add(2)


# --- the plain loop and the engine agree ------------------------------------------------------

PROMPT = "the cache holds keys"


def _plain(engine: LLMEngine, params: SamplingParams) -> tuple[list[str], list[int], str, str]:
    gen = Generation(engine.model, engine.tokenizer.encode(PROMPT), params, engine.tokenizer)
    deltas = [d.text for d in gen]
    assert gen.result is not None
    return deltas, gen.result.token_ids, gen.result.text, gen.result.finish_reason


def test_plain_loop_and_engine_end_alike(tmp_path):
    """Every stop rule, run as one engine batch and one by one through the plain loop: the same
    streamed deltas, tokens, text and finish reason."""
    engine = tiny_bridge(tmp_path).engine
    tok = engine.tokenizer
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, ids, text, _ = _plain(engine, free)
    pieces = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    # a stop string cut across two tokens: the last character of one, the first of the next
    cut = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) > 1 and len(pieces[i]) > len(pieces[i - 1]))
    across = text[len(pieces[cut - 1]) - 1:len(pieces[cut - 1]) + 1]
    engine.model.eos_token_ids = (ids[9],)
    cases = {
        "stop string across tokens": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(across,)),
        "stop id": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=(ids[5],)),
        "eos": SamplingParams(temperature=0, max_tokens=30),
        "eos ignored": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        "max tokens": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, stop=("\x00never",)),
        "seeded": SamplingParams(temperature=0.9, top_k=20, seed=4, max_tokens=15, stop=(text[8:10],)),
    }
    rids = {name: engine.add_request(PROMPT, p) for name, p in cases.items()}
    streamed: dict[str, list[str]] = {rid: [] for rid in rids.values()}
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            streamed[o.request_id].append(o.new_text)
            if o.finished:
                final[o.request_id] = o
    reasons = {}
    for name, p in cases.items():
        o = final[rids[name]]
        assert (streamed[rids[name]], o.token_ids, o.text, o.finish_reason) == _plain(engine, p), name
        reasons[name] = o.finish_reason
    assert reasons == {"stop string across tokens": "stop", "stop id": "stop", "eos": "stop",
                       "eos ignored": "length", "max tokens": "length", "seeded": reasons["seeded"]}
    assert final[rids["stop string across tokens"]].text == text[:text.find(across)]
