"""The official `openai` client against our /v1, unchanged: models, chat, streaming chat."""
from __future__ import annotations

import openai
import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def client(api_server):
    return OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _messages(server):
    return [{"role": "user", "content": server.question}]


RAG = {"rag": {"namespace": "musique", "top_k": 3, "mode": "cacheblend"}}


def test_models_lists_the_served_model(client, smollm):
    assert [m.id for m in client.models.list().data] == [smollm.path.name]  # the checkpoint's folder


def test_chat_answers_with_the_retrieved_chunks(client, model, api_server):
    r = client.chat.completions.create(model=model, messages=_messages(api_server), max_tokens=12,
                                       temperature=0, extra_body=RAG)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and r.usage.completion_tokens <= 12
    rag = r.model_extra["rag"]
    assert len(rag["chunks"]) == 3 and rag["mode"] == "cacheblend"
    assert r.usage.prompt_tokens == rag["usage"]["prompt_tokens"]


def test_streamed_chat_equals_the_plain_answer(client, model, api_server):
    kwargs = dict(model=model, messages=_messages(api_server), max_tokens=16, temperature=0, extra_body=RAG)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    deltas, usage, finish = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert sum(1 for d in deltas if d) >= 2  # tokens arrived one by one, before the end
    assert "".join(deltas) == plain and finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens >= 1


def test_conversation_and_system_message(client, model, api_server):
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Who wrote Hannibal and Scipio?"},
                {"role": "assistant", "content": "Thomas Nabbes."},
                {"role": "user", "content": [{"type": "text", "text": "Where was he educated?"}]}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, extra_body=RAG)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 0


def test_errors_reach_the_client_as_openai_errors(client, model, api_server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=_messages(api_server))
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=model, messages=[{"role": "assistant", "content": "hi"}])
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=model, messages=_messages(api_server), n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=model, messages=_messages(api_server),
                                       extra_body={"rag": {"namespace": "nothing-here"}})
