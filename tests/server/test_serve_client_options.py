"""Options for clients, served and offline: server.chat_template (--chat-template), a template
file or text that renders chat requests instead of the checkpoint's (one that is neither, or
does not parse, stops `tidal serve` before it loads); server.allowed_origins (--allowed-origin),
the browser origins that get CORS headers; LLM.chat's chat_template and generate's use_tqdm."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server.tiny_server import ServerProcess, serve
from tidal import LLM, SamplingParams
from tidal.loader.chat_template import read_chat_template

UI = "http://ui.test:3000"
AUTH = {"Authorization": "Bearer k"}
# Plain turns: "user: hi\n" ... then "bot:" for the reply.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}bot:{% endif %}"
)


@pytest.fixture(scope="module")
def server(
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("template") / "plain.jinja"
    path.write_text(TEMPLATE)
    yield from serve(
        ["--model", str(tiny_checkpoint), "--kv-cache-bytes", str(4 << 20),
         "--chat-template", str(path), "--allowed-origin", UI, "--api-key", "k", "--no-warmup"]
    )  # fmt: skip


def test_the_file_renders_chat_requests(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "hi"}]
    ids = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": messages}, headers=AUTH
    ).json()["tokens"]
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}, headers=AUTH).json()[
        "prompt"
    ]
    assert text == "user: hi\nbot:"
    reply = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "temperature": 0},
        headers=AUTH,
        timeout=60,
    ).json()
    assert reply["usage"]["prompt_tokens"] == len(ids)


def test_text_is_a_template_and_anything_else_is_refused(tmp_path: Path) -> None:
    assert read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="not a file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        read_chat_template("{% for m in messages %}")
    # tidal serve stops at once, naming the key, before any model is loaded.
    run = subprocess.run(
        [sys.executable, "-m", "tidal.cli_serve", "--chat-template", str(tmp_path / "x.jinja"),
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "server.chat_template" in run.stderr and "not a file" in run.stderr


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), kv_cache_bytes=4 << 20)


def test_llm_chat_renders_with_a_given_template(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "hi"}], params, chat_template=TEMPLATE)[0]
    ids = llm.get_tokenizer().encode("user: hi\nbot:", add_special_tokens=False)
    assert out.prompt_token_ids == ids
    same = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


def test_llm_generate_shows_progress_and_takes_prompt_dicts(llm: LLM, capsys) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    quiet = llm.generate(["a", "bb", "ccc"], params)
    assert "requests" not in capsys.readouterr().err
    shown = llm.generate(["a", "bb", "ccc"], params, use_tqdm=True)
    assert "3/3" in capsys.readouterr().err  # tqdm's bar on stderr, every request counted
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in quiet]
    # vLLM's prompt dicts, text or token ids, give the same outputs; other keys are refused.
    ids = llm.get_tokenizer().encode("bb")
    dicts = llm.generate([{"prompt": "a"}, {"prompt_token_ids": ids}], params)
    assert [o.outputs[0].token_ids for o in dicts] == [
        quiet[0].outputs[0].token_ids,
        quiet[1].outputs[0].token_ids,
    ]
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "a", "multi_modal_data": {}}, params)


def test_an_allowed_origin_gets_cors_headers_and_others_none(server: ServerProcess) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    ask = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    pre = httpx.options(url, headers={"Origin": UI, **ask})  # no key: browsers send none here
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == UI
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    other = httpx.options(url, headers={"Origin": "http://elsewhere.test", **ask})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    call = httpx.post(url, json=body, headers={"Origin": UI, **AUTH}, timeout=60)
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == UI
    # The key is still needed: CORS only lets the browser read the answer.
    assert httpx.post(url, json=body, headers={"Origin": UI}).status_code == 401


def test_llm_chat_continues_a_message_and_passes_template_kwargs(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "It is"}]
    out = llm.chat(turns, params, chat_template=TEMPLATE, continue_final_message=True)[0]
    assert out.prompt_token_ids == tok.encode(
        "user: hi\nassistant: It is", add_special_tokens=False
    )
    bare = llm.chat(turns[:1], params, chat_template=TEMPLATE, add_generation_prompt=False)[0]
    assert bare.prompt_token_ids == tok.encode("user: hi\n", add_special_tokens=False)
    tagged = TEMPLATE + "{{ tag }}"
    kw = llm.chat(turns[:1], params, chat_template=tagged, chat_template_kwargs={"tag": "!"})[0]
    assert kw.prompt_token_ids == tok.encode("user: hi\nbot:!", add_special_tokens=False)
    with pytest.raises(ValueError, match="assistant message last"):
        llm.chat(turns[:1], params, continue_final_message=True)


def test_llm_chat_passes_tools_to_a_template_that_lists_them(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    tools = [{"type": "function", "function": {"name": "tide", "parameters": {"type": "object"}}}]
    listing = "{% for t in tools %}tool {{ t.function.name }}\n{% endfor %}" + TEMPLATE
    out = llm.chat([{"role": "user", "content": "hi"}], params, chat_template=listing, tools=tools)
    assert out[0].prompt_token_ids == tok.encode(
        "tool tide\nuser: hi\nbot:", add_special_tokens=False
    )
    with pytest.raises(ValueError, match="never reads them"):  # not silently left out
        llm.chat([{"role": "user", "content": "hi"}], params, chat_template=TEMPLATE, tools=tools)
