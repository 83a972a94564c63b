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


def test_a_rag_option_at_the_top_level_a_non_text_part_and_a_lone_surrogate_are_422s_naming_them(client, model,
                                                                                                   api_server):
    """Unknown fields are ignored, as OpenAI-compatible servers do, but a RAG option outside `rag` would answer from
    the default namespace without a word: a 422 that says where it goes. An image part, or text JSON escapes cut
    into half a surrogate pair, is named too, not a tokenizer's internals."""
    for extra in ({"namespace": "musique"}, {"top_k": 2, "rag": {"namespace": "musique"}}):
        with pytest.raises(openai.UnprocessableEntityError) as bad:
            client.chat.completions.create(model=model, messages=_messages(api_server), extra_body=extra)
        key = next(k for k in extra if k != "rag")
        assert f'"{key}" is a RAG option: it goes inside "rag"' in bad.value.body["message"]
    image = [{"type": "text", "text": "who?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": image}], extra_body=RAG)
    assert bad.value.body["param"] == "messages.0.content"
    assert "part 1 is of type 'image_url'" in bad.value.body["message"]
    with api_server.client() as c:  # the client library cannot send one: JSON escapes can
        for raw in (b'[{"role": "user", "content": "who \\ud800?"}]',  # in a string, and in a part
                    b'[{"role": "system", "content": [{"type": "text", "text": "\\udc00"}]}, '
                    b'{"role": "user", "content": "who?"}]'):
            r = c.post("/v1/chat/completions", content=b'{"model": "%s", "messages": %s}' % (model.encode(), raw),
                       headers={"content-type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 422 and "lone UTF-16 surrogate" in err["message"], r.text
            assert err["param"] == "messages.0.content", err
    assert client.chat.completions.create(model=model, messages=_messages(api_server), max_tokens=2,
                                          extra_body=RAG).choices[0].message.content  # and the server still answers
