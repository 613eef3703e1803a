"""A real `tidal serve` subprocess on a tiny random model, driven by the official openai SDK."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import openai
import pytest

import tidal
from tests.server.conftest import API_KEY
from tests.server.tiny_server import ServerProcess

MODEL = "tiny"


def _client(server: ServerProcess, **kw) -> openai.OpenAI:
    return openai.OpenAI(
        api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0, timeout=60, **kw
    )


def _greedy_completion(client: openai.OpenAI, prompt: str, max_tokens: int = 12, **kw):
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}, **kw,
    )  # fmt: skip


def test_models_health_ready(server: ServerProcess) -> None:
    client = _client(server)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("nope")
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/ready").status_code == 200
    assert httpx.get(server.base_url + "/version").json() == {"version": tidal.__version__}
    # No server.allowed_origins: no CORS headers for a page in a browser.
    page = httpx.get(server.base_url + "/health", headers={"Origin": "http://ui.test"})
    assert "access-control-allow-origin" not in page.headers


def test_each_finished_request_is_one_log_line(server: ServerProcess) -> None:
    out = _client(server).completions.create(
        model=MODEL, prompt="Log me", max_tokens=5, n=2, temperature=0, extra_body={"ignore_eos": True}
    )  # fmt: skip
    line = f"request {out.id}-0: length; prompt {out.usage.prompt_tokens} tokens ("
    server.wait_until(lambda: line in server.log, "the request's log line", 30)
    logged = next(entry for entry in server.log.splitlines() if line in entry)
    assert "cached), 10 output; queued " in logged and "first token" in logged
    assert "Log me" not in logged  # counts and timings, never the text


def test_completion_stream_equals_non_stream(server: ServerProcess) -> None:
    client = _client(server)
    full = _greedy_completion(client, "Hello there", max_tokens=10)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    assert full.usage.prompt_tokens == len("Hello there") + 1  # char-level + BOS
    stream = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text != ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_continuous_usage_stats_put_the_counts_so_far_on_every_chunk(
    server: ServerProcess,
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, body in (
        (_client(server).completions.create, {"prompt": "Hello there"}),
        (
            _client(server).chat.completions.create,
            {"messages": [{"role": "user", "content": "Hi"}]},
        ),
    ):
        chunks = list(
            create(model=MODEL, max_tokens=6, temperature=0, stream=True, stream_options=options,
                   extra_body={"ignore_eos": True}, **body)
        )  # fmt: skip
        counts = [c.usage.completion_tokens for c in chunks]
        assert None not in counts and counts == sorted(counts) and counts[-1] == 6, counts
        assert chunks[-1].choices == [] and chunks[0].usage.prompt_tokens > 0


def test_chat_stream_equals_non_stream(server: ServerProcess) -> None:
    client = _client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completion_logprobs(server: ServerProcess) -> None:
    out = _greedy_completion(_client(server), "Tide", max_tokens=6, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # Special tokens have logprobs but no text (skip_special_tokens).
    assert "".join(t for t in lp.tokens if not t.startswith("<")) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 2 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob)
        assert top[token] == pytest.approx(logprob)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs(server: ServerProcess, max_tokens: int) -> None:
    prompt = "Echo me"
    out = _greedy_completion(_client(server), prompt, max_tokens=max_tokens, logprobs=1, echo=True)
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    num_prompt = len(prompt) + 1  # BOS
    lp = choice.logprobs
    assert len(lp.tokens) == num_prompt + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts BOS
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[1:num_prompt]) == prompt
    assert out.usage.completion_tokens == max_tokens


def test_n2_and_seed(server: ServerProcess) -> None:
    client = _client(server)
    kw = dict(model=MODEL, prompt="Once", max_tokens=8, temperature=1.0, n=2, seed=1234,
              extra_body={"ignore_eos": True})  # fmt: skip
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 16
    c = client.completions.create(**{**kw, "seed": 99})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]
    greedy = client.completions.create(**{**kw, "temperature": 0.0})
    assert greedy.choices[0].text == greedy.choices[1].text


def test_stop_string_cuts_output(server: ServerProcess) -> None:
    client = _client(server)
    text = _greedy_completion(client, "Stop here", max_tokens=16).choices[0].text
    stop = text[6:8]
    expected = text[: text.find(stop)]
    out = _greedy_completion(client, "Stop here", max_tokens=16, stop=[stop])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"


def test_prompt_as_token_ids(server: ServerProcess) -> None:
    client = _client(server)
    ids = httpx.post(
        server.base_url + "/tokenize", json={"prompt": "Hello"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["tokens"]  # fmt: skip
    by_text = _greedy_completion(client, "Hello", max_tokens=5)
    by_ids = _greedy_completion(client, ids, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    back = httpx.post(
        server.base_url + "/detokenize", json={"tokens": ids[1:]},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()  # fmt: skip
    assert back == {"prompt": "Hello"}


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: ServerProcess) -> None:
    out = _client(server).completions.create(
        model=MODEL, prompt="Hello there", max_tokens=1, temperature=0, echo=True,
        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5},
    )  # fmt: skip
    assert out.usage.prompt_tokens == 5  # BOS and "here"
    assert out.choices[0].text.startswith("here") and len(out.choices[0].text) == 5


def test_chat_logprobs(server: ServerProcess) -> None:
    out = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hey"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert entry.bytes == list(entry.token.encode())


def test_32_concurrent_streams_match_solo(server: ServerProcess) -> None:
    prompts = [f"Prompt {i} says" for i in range(32)]
    client = _client(server)
    solo = [_greedy_completion(client, p, max_tokens=8).choices[0].text for p in prompts]

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(
            api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0, timeout=60
        )

        async def one(p: str) -> str:
            stream = await aclient.completions.create(
                model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(run_all()) == solo


def test_bundled_model_over_http_matches_transformers(bundled_gguf) -> None:
    """The bundled Gemma 3 270M served over HTTP (greedy) gives transformers' greedy tokens on the
    same file: the completion and the chat reply are the reference fixture's ids
    (tests/models/fixtures, checked against transformers by the `reference` tests), decoded."""
    from tests.models.reference_gguf import load_fixture
    from tests.server.tiny_server import serve
    from tidal.loader.tokenizer import load_tokenizer

    cases = {c["name"]: c for c in load_fixture()["prompts"]}
    tok = load_tokenizer(bundled_gguf)
    for srv in serve(["--kv-cache-bytes", str(64 << 20), "--max-model-len", "512"]):
        client = openai.OpenAI(
            api_key="none", base_url=srv.base_url + "/v1", max_retries=0, timeout=120
        )
        model = client.models.list().data[0].id
        short = cases["short_english"]
        out = client.completions.create(
            model=model, prompt=short["text"], max_tokens=8, temperature=0
        )
        assert out.usage.prompt_tokens == len(short["prompt_ids"])
        assert out.choices[0].text == tok.decode(short["greedy_ids"][:8])
        # The fixture's chat prompt is this message through Gemma's template.
        chat_case = cases["chat"]
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Write a haiku about autumn leaves."}],
            max_tokens=16,
            temperature=0,
        )
        assert chat.usage.prompt_tokens == len(chat_case["prompt_ids"])
        assert chat.choices[0].message.content == tok.decode(chat_case["greedy_ids"][:16])


def test_logit_bias_forces_bans_and_refuses(server: ServerProcess) -> None:
    client = _client(server)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    forced = httpx.post(
        server.base_url + "/tokenize", json={"prompt": "Hello"}, headers=headers
    ).json()["tokens"][-1]
    piece = httpx.post(
        server.base_url + "/detokenize", json={"tokens": [forced]}, headers=headers
    ).json()["prompt"]
    out = _greedy_completion(client, "Tide", max_tokens=4, logit_bias={str(forced): 100})
    assert out.choices[0].text == piece * 4

    plain = _greedy_completion(client, "Tide", max_tokens=1, logprobs=1)
    first = plain.choices[0].logprobs.tokens[0]
    first_id = httpx.post(
        server.base_url + "/tokenize", json={"prompt": first, "add_special_tokens": False},
        headers=headers,
    ).json()["tokens"]  # fmt: skip
    assert len(first_id) == 1, first_id  # the tiny vocabulary re-tokenizes a piece to itself
    banned = _greedy_completion(
        client, "Tide", max_tokens=1, logprobs=1, logit_bias={str(first_id[0]): -100}
    )
    assert banned.choices[0].logprobs.tokens[0] != first

    with pytest.raises(openai.BadRequestError) as e:
        _greedy_completion(client, "Tide", max_tokens=1, logit_bias={"99999999": 5})
    assert e.value.body["param"] == "logit_bias" and "outside the vocabulary" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tool_choice="auto"
        )
    assert e.value.body["param"] == "tool_choice"


def test_return_token_ids_gives_the_prompts_and_choices_ids(server: ServerProcess) -> None:
    """vLLM's return_token_ids (RL rollouts train on the exact ids): in whole replies and in
    streams, which carry the same ids; replies that do not ask keep OpenAI's shape."""
    c = _client(server)
    ask = {"return_token_ids": True, "ignore_eos": True}
    whole = c.completions.create(
        model=MODEL, prompt="Ids", max_tokens=4, n=2, temperature=0, extra_body=ask
    )
    prompt = httpx.post(
        server.base_url + "/tokenize",
        json={"prompt": "Ids"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ).json()["tokens"]
    for ch in whole.choices:
        extra = ch.model_extra
        assert extra["prompt_token_ids"] == prompt and len(extra["token_ids"]) == 4
    streamed: dict[int, list[int]] = {0: [], 1: []}
    firsts = {}
    for chunk in c.completions.create(
        model=MODEL, prompt="Ids", max_tokens=4, n=2, temperature=0, stream=True, extra_body=ask
    ):
        for ch in chunk.choices:
            streamed[ch.index] += ch.model_extra["token_ids"]
            firsts.setdefault(ch.index, ch.model_extra.get("prompt_token_ids"))
    assert streamed == {ch.index: ch.model_extra["token_ids"] for ch in whole.choices}
    assert firsts == {0: prompt, 1: prompt}  # on each choice's first chunk
    messages = [{"role": "user", "content": "Ids"}]
    chat = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body=ask
    )
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(ids) == chat.usage.completion_tokens == 4
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
            extra_body=ask,
        )
    )  # fmt: skip
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [
        t for k in chunks for ch in k.choices for t in ch.model_extra.get("token_ids") or []
    ] == ids
    # not asked: no such keys at all
    plain = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Ids", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_prompt_logprobs_score_the_prompt_as_echo_does(server: ServerProcess) -> None:
    """vLLM's prompt_logprobs: per prompt position the top-k and the prompt's own token; the
    own token's logprob is echo + logprobs' for the same position."""
    c = _client(server)
    out = c.completions.create(
        model=MODEL, prompt="Score me", max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )  # fmt: skip
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == out.usage.prompt_tokens
    echo = c.completions.create(
        model=MODEL, prompt="Score me", max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    echoed = echo.choices[0].logprobs.token_logprobs[: len(plp)]
    ids = c.completions.create(
        model=MODEL, prompt="Score me", max_tokens=1, extra_body={"return_token_ids": True}
    ).choices[0].model_extra["prompt_token_ids"]  # fmt: skip
    for pos in range(1, len(plp)):
        entry = plp[pos]
        own = entry[str(ids[pos])]
        assert own["logprob"] == pytest.approx(echoed[pos], abs=1e-5)
        assert sum(1 for e in entry.values() if e["rank"] <= 2) == 2  # the top two
        assert len(entry) <= 3 and all(e["decoded_token"] is not None for e in entry.values())
    streamed = [
        ch.model_extra.get("prompt_logprobs")
        for chunk in c.completions.create(
            model=MODEL, prompt="Score me", max_tokens=2, temperature=0, stream=True,
            extra_body={"prompt_logprobs": 2},
        )
        for ch in chunk.choices
    ]  # fmt: skip
    assert streamed[0] == plp and all(p is None for p in streamed[1:])
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Score me"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    chat_plp = chat.model_extra["prompt_logprobs"]
    assert len(chat_plp) == chat.usage.prompt_tokens and all(len(e) == 1 for e in chat_plp[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs=21 is invalid"):
        c.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 21}
        )
