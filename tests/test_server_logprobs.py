"""logprobs, top_logprobs and echo as vLLM serves them, through the official openai client:
completions' parallel lists, chat's content entries, streamed and not, and the figures equal to
the model's own log-softmax (the tiny fp32 model, so no rounding ties)."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from kvlab.generate import Generation
from kvlab.models.attention import NoCache
from kvlab.sampling import SamplingParams
from tests.test_server_fixtures import MODEL_ID, server  # noqa: F401

openai = pytest.importorskip("openai")

PROMPT = "the cache holds keys and values"


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _full_logprobs(server, ids: list[int]) -> torch.Tensor:  # noqa: F811
    """log-softmax at every position of one uncached pass of the served model."""
    model = server.bridge.engine.model
    backend = NoCache(model.spec)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), backend.prepare(len(ids), "cpu"), backend, None)
    return torch.log_softmax(logits.float(), -1)


def _check_offsets(lp) -> None:
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]


def test_completion_logprobs_are_the_models(client, server):  # noqa: F811
    res = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    c = res.choices[0]
    lp = c.logprobs
    tok = server.bridge.tokenizer
    ids = tok.encode(PROMPT)
    plain = list(Generation(server.bridge.engine.model, ids, SamplingParams(temperature=0, max_tokens=6,
                                                                           ignore_eos=True, logprobs=3)))
    assert lp.tokens == [tok.decode([d.token_id]) for d in plain] and "".join(lp.tokens) == c.text
    assert lp.token_logprobs == pytest.approx([d.logprob.logprob for d in plain], abs=1e-4)
    for shown, d in zip(lp.top_logprobs, plain, strict=True):
        assert shown == pytest.approx({tok.decode([t]): v for t, v in d.logprob.top}, abs=1e-4)
    _check_offsets(lp)


def test_echo_scores_the_prompt(client, server):  # noqa: F811
    res = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                    echo=True)
    c = res.choices[0]
    lp = c.logprobs
    ids = server.bridge.tokenizer.encode(PROMPT)
    assert c.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    full = _full_logprobs(server, ids)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([full[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                                          abs=1e-4)
    for p in range(1, len(ids)):  # the best token, plus the prompt's own when it is not the best
        best = full[p - 1].argmax().item()
        assert len(lp.top_logprobs[p]) == (1 if best == ids[p] else 2)
        assert lp.top_logprobs[p][lp.tokens[p]] == pytest.approx(lp.token_logprobs[p], abs=1e-6)
    _check_offsets(lp)
    plain = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None


def test_streamed_logprobs_equal_the_whole(client):
    kwargs = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, echo=True,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    parts = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(p.text for p in parts) == whole.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(p.logprobs, key) for p in parts), []) == getattr(whole.logprobs, key)


def test_chat_logprobs_and_top_logprobs(client, server):  # noqa: F811
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    choice = client.chat.completions.create(**kwargs).choices[0]
    content = choice.logprobs.content
    assert len(content) == 5 and "".join(e.token for e in content) == choice.message.content
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the best token
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-5
    streamed = [e for c in client.chat.completions.create(stream=True, **kwargs)
                for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    bare = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None}).choices[0]
    assert bare.logprobs is None
    only = client.chat.completions.create(**{**kwargs, "top_logprobs": None}).choices[0]
    assert [e.top_logprobs for e in only.logprobs.content] == [[]] * 5


def test_logprob_requests_the_api_refuses(server):  # noqa: F811
    with httpx.Client(base_url=server.url, timeout=30) as http:
        chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "hi", "logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_body_that_is_not_json_is_named(server):  # noqa: F811
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/completions", content=b'{"model": "x", "prompt": "hi"}',
                      headers={"content-type": "text/plain"})
        assert r.status_code == 415
        err = r.json()["error"]
        assert "Content-Type: application/json" in err["message"] and "text/plain" in err["message"]
        assert err["code"] == "unsupported_media_type"
