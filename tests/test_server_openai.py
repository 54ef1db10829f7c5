"""The OpenAI-compatible API through the official `openai` client: completions and chat, streamed
and not, usage with cached prompt tokens, n, seed, stop, the chat template and the API key."""

from __future__ import annotations

import httpx
import pytest

from kvlab.models.chat import DEFAULT_TEMPLATE, ChatTemplate
from tests.test_server_fixtures import MODEL_ID, LiveServer, server, tiny_bridge  # noqa: F401

openai = pytest.importorskip("openai")

PROMPT = "the cache holds keys and values of every earlier token"


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_served_model(client, server):  # noqa: F811
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID]
    assert models[0].model_extra["max_model_len"] == server.bridge.max_model_len


def test_completion_matches_the_engine_run_alone(client, server):  # noqa: F811
    res = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    choice = res.choices[0]
    assert choice.finish_reason == "length" and res.usage.completion_tokens == 12
    ids = server.bridge.tokenizer.encode(PROMPT)
    assert res.usage.prompt_tokens == len(ids) and res.usage.total_tokens == len(ids) + 12
    from kvlab.generate import generate
    from kvlab.sampling import SamplingParams

    alone = generate(server.bridge.engine.model, ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                     server.bridge.tokenizer)
    assert choice.text == alone.text  # the paged engine behind HTTP = the plain loop


def test_streamed_completion_equals_the_plain_one(client):
    kwargs = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_repeated_prompt_reports_cached_tokens(client, server):  # noqa: F811
    prompt = "a prompt of its own, repeated to hit the prefix cache: " + PROMPT
    n_prompt = len(server.bridge.tokenizer.encode(prompt))
    block = server.bridge.engine.capacity.block_size
    first = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full block of the prompt but the one holding its last token (which must be recomputed)
    assert again.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // block * block > 0
    assert again.choices[0].text == first.choices[0].text


def test_chat_plain_and_streamed(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    res = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert res.object == "chat.completion" and res.choices[0].message.role == "assistant"
    assert res.usage.completion_tokens == 8
    text = res.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_prompt_uses_the_template(client, server):  # noqa: F811
    messages = [{"role": "user", "content": "hello"}]
    expected = ChatTemplate(DEFAULT_TEMPLATE).render(messages)
    assert expected == "user: hello\nassistant:"
    res = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=1)
    assert res.usage.prompt_tokens == len(server.bridge.tokenizer.encode(expected))


def test_n_choices_with_a_seed_are_reproducible(client):
    kwargs = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7,
                  extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # seed + i per choice: not three copies
    assert a.usage.completion_tokens == 24
    streamed = client.completions.create(stream=True, **kwargs)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in a.choices]


def test_batch_of_prompts_and_stop_string(client):
    res = client.completions.create(model=MODEL_ID, prompt=[PROMPT, "hello"], max_tokens=6, temperature=0)
    assert [c.index for c in res.choices] == [0, 1]
    full = res.choices[0].text
    k = next(k for k in range(1, len(full) - 1) if full[k:k + 2].strip() and full.index(full[k:k + 2]) == k)
    cut = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0,
                                    stop=[full[k:k + 2]])
    assert cut.choices[0].text == full[:k] and cut.choices[0].finish_reason == "stop"


def test_token_id_prompts(client, server):  # noqa: F811
    ids = server.bridge.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_api_key_is_required_when_set(tmp_path):
    live = LiveServer(tiny_bridge(tmp_path), api_key="sekrit")
    try:
        bad = openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == MODEL_ID
        assert httpx.get(f"{live.url}/health").status_code == 200  # health and the page stay open
    finally:
        live.stop()


def test_checkpoint_chat_template(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    from tests.test_server_fixtures import make_tiny_model

    folder = make_tiny_model(tmp_path, chat_template=template).parent
    t = ChatTemplate.from_checkpoint(folder)
    assert t.render([{"role": "user", "content": "hi"}]) == "<|user|>hi<eos><|assistant|>"
    with pytest.raises(Exception, match="chat template"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
