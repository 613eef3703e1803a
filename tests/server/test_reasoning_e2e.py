"""Reasoning output end to end: a real `tidal serve` on a tiny R1-style checkpoint, read with the
official openai SDK (`message.reasoning_content`, `delta.reasoning_content`, reasoning tokens).

The checkpoint is a tiny random Gemma 3 with a DeepSeek vocabulary and no chat template, so the
server picks the built-in R1 template (its generation prompt ends with "<think>\\n") and `auto`
picks the deepseek_r1 parser. A random model never writes "</think>" by itself, so the fixture
makes it: it runs the model greedily once (tidal.LLM, the same engine), restricted by logit_bias
to the vocabulary's filler words, sees which id comes out first at step K >= 2, and gives that id
the text "</think>" in the tokenizer the server loads. Greedy decoding depends on ids only, so the
server's output then has K reasoning tokens, the end tag, and an answer: known in advance, real.
"""

from __future__ import annotations

import json
import string
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from tests.server.conftest import KV_BYTES
from tests.server.tiny_server import VOCAB_SIZE, ServerProcess, serve

MODEL = "tiny-r1"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIALS = ["<pad>", "<unk>", BOS, EOS, "<｜User｜>", "<｜Assistant｜>"]
TAGS = ["<think>", "</think>"]  # plain added tokens, as in R1's tokenizer (not special)
CHARS = string.ascii_letters + string.digits + " .,?!\n"
NUM_WORDS = VOCAB_SIZE - len(SPECIALS) - len(TAGS) - len(CHARS)
MAX_TOKENS = 10
USER = [{"role": "user", "content": "What is 2+2?"}]
# Without them the tiny model repeats one word forever; with them it moves on to a new one.
PENALTIES = {"presence_penalty": 2.0, "frequency_penalty": 2.0}


def _write_tokenizer(out_dir: Path, texts: list[str], special_tags: bool = False) -> None:
    """texts[i] is id i's text; the char-level split never produces the filler words."""
    vocab = {t: i for i, t in enumerate(texts)}
    assert len(vocab) == VOCAB_SIZE
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=special_tags, normalized=False) for t in TAGS])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": "<pad>", "add_bos_token": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


@dataclass(frozen=True)
class Forced:
    """What the server's greedy answer to USER (under `bias` and PENALTIES) is known to be."""

    bias: dict[str, int]  # logit_bias: the filler words only
    reasoning: str
    content: str
    raw: str  # the whole output text, end tag included
    num_reasoning: int  # K


@pytest.fixture(scope="module")
def r1_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Forced]:
    from tests.models.tiny_hf import make_tiny_model
    from tidal import LLM
    from tidal.sampling_params import SamplingParams

    out_dir = tmp_path_factory.mktemp("tiny_r1")
    make_tiny_model("gemma3", out_dir, seed=0)
    texts = SPECIALS + TAGS + list(CHARS) + [f" w{i}" for i in range(NUM_WORDS)]
    _write_tokenizer(out_dir, texts)
    word_ids = range(VOCAB_SIZE - NUM_WORDS, VOCAB_SIZE)
    llm = LLM(str(out_dir), kv_cache_bytes=int(KV_BYTES))
    assert llm.get_tokenizer().family == "deepseek_r1"  # no template here: the built-in R1 one
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        logit_bias={i: 100.0 for i in word_ids},
        **PENALTIES,
    )
    ids = llm.chat(USER, params)[0].outputs[0].token_ids
    del llm
    k = next((k for k in range(2, len(ids)) if ids[k] not in ids[:k]), None)
    assert k is not None, f"greedy output {ids} repeats itself: no step can carry the end tag"
    # Swap texts: id ids[k] becomes "</think>", the end tag's first id a filler word. Neither
    # occurs in the prompt, whose ids stay the same, so the model's greedy ids stay the same.
    end_id = texts.index("</think>")
    texts[end_id], texts[ids[k]] = texts[ids[k]], texts[end_id]
    _write_tokenizer(out_dir, texts)
    forced = Forced(
        bias={str(i): 100 for i in word_ids},
        reasoning="".join(texts[i] for i in ids[:k]).lstrip(),
        content="".join(texts[i] for i in ids[k + 1 :]).lstrip(),
        raw="".join(texts[i] for i in ids),
        num_reasoning=k,
    )
    return out_dir, forced


@pytest.fixture(scope="module")
def r1_server(r1_checkpoint: tuple[Path, Forced]) -> Iterator[tuple[ServerProcess, Forced]]:
    out_dir, forced = r1_checkpoint
    args = ["--model", str(out_dir), "--kv-cache-bytes", KV_BYTES, "--served-model-name", MODEL]
    for server in serve(args):
        yield server, forced


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="none", base_url=server.base_url + "/v1", max_retries=0, timeout=60
    )


def _chat(server: ServerProcess, forced: Forced, **kw):
    return _client(server).chat.completions.create(
        model=MODEL, messages=USER, temperature=0, logit_bias=forced.bias, **PENALTIES, **kw
    )


def test_the_server_picks_the_r1_parser_and_template(r1_server) -> None:
    server, forced = r1_server
    assert "reasoning parser: deepseek_r1" in server.log
    assert forced.reasoning and forced.content  # both parts have words in them


def test_chat_returns_reasoning_apart_from_the_answer(r1_server) -> None:
    server, forced = r1_server
    out = _chat(server, forced, max_tokens=MAX_TOKENS, n=2)
    for choice in out.choices:
        msg = choice.message
        assert msg.model_extra["reasoning_content"] == forced.reasoning
        assert msg.model_extra["reasoning"] == forced.reasoning  # vLLM's newer name
        assert msg.content == forced.content
        assert "</think>" not in msg.content and "<think>" not in forced.reasoning
    assert out.usage.completion_tokens == 2 * MAX_TOKENS
    details = out.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == 2 * forced.num_reasoning


def test_a_stream_splits_the_same_way(r1_server) -> None:
    server, forced = r1_server
    stream = _chat(
        server, forced, max_tokens=MAX_TOKENS, n=2, stream=True, logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        reasoning = [ch.delta.model_extra.get("reasoning_content") for ch in mine]
        content = [ch.delta.content for ch in mine]
        assert "".join(r for r in reasoning if r) == forced.reasoning
        assert "".join(c for c in content if c) == forced.content
        # Reasoning streams first, then content; no delta carries both.
        assert not any(r and c for r, c in zip(reasoning, content, strict=True))
        last_reasoning = max(i for i, r in enumerate(reasoning) if r)
        assert all(not c for c in content[:last_reasoning])
        # Logprobs stay one entry per token, reasoning tokens and the end tag included.
        entries = [e for ch in mine if ch.logprobs for e in ch.logprobs.content]
        assert len(entries) == MAX_TOKENS
        assert "".join(e.token for e in entries) == forced.raw
        assert mine[-1].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 2 * MAX_TOKENS
    assert usage.completion_tokens_details.reasoning_tokens == 2 * forced.num_reasoning


def test_responses_return_a_reasoning_item_then_the_message(r1_server) -> None:
    server, forced = r1_server
    body = {
        "model": MODEL, "input": USER, "temperature": 0, "max_output_tokens": MAX_TOKENS,
        "extra_body": {"logit_bias": forced.bias, **PENALTIES},
    }  # fmt: skip
    resp = _client(server).responses.create(**body)
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == forced.reasoning
    assert message.type == "message" and resp.output_text == forced.content
    assert resp.usage.output_tokens_details.reasoning_tokens == forced.num_reasoning
    events = list(_client(server).responses.create(**body, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (forced.reasoning, forced.content)
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"]  # the thought's item closes before the answer's


def test_no_end_tag_is_all_reasoning(r1_server) -> None:
    server, forced = r1_server
    k = forced.num_reasoning
    out = _chat(server, forced, max_tokens=k)  # stops just before the end tag
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content is None
    assert out.choices[0].message.model_extra["reasoning_content"] == forced.reasoning
    assert out.usage.completion_tokens_details.reasoning_tokens == k
    stream = _chat(
        server, forced, max_tokens=k, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == forced.reasoning
    # Every chunk's usage: all tokens so far are reasoning tokens.
    counts = [
        (c.usage.completion_tokens, c.usage.completion_tokens_details.reasoning_tokens)
        for c in chunks
    ]
    assert all(done == reasoning for done, reasoning in counts) and counts[-1] == (k, k)


def test_completions_return_the_raw_text(r1_server) -> None:
    server, forced = r1_server
    prompt = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
    out = _client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logit_bias=forced.bias,
        extra_body={"add_special_tokens": False}, **PENALTIES,
    )  # fmt: skip
    assert out.choices[0].text == forced.raw and "</think>" in forced.raw
    assert out.usage.completion_tokens_details is None


def test_a_parser_whose_tags_detokenizing_drops_stops_the_server(
    r1_checkpoint: tuple[Path, Forced], tmp_path: Path
) -> None:
    out_dir, _ = r1_checkpoint
    special = tmp_path / "special_tags"
    special.mkdir()
    for f in out_dir.iterdir():
        if f.name != "tokenizer.json":
            (special / f.name).symlink_to(f)
    texts = SPECIALS + TAGS + list(CHARS) + [f" w{i}" for i in range(NUM_WORDS)]
    _write_tokenizer(special, texts, special_tags=True)
    cmd = [
        sys.executable, "-m", "tidal.cli_serve", "--host", "127.0.0.1", "--port", "0",
        "--model", str(special), "--kv-cache-bytes", KV_BYTES, "--no-warmup",
        "--reasoning-parser", "deepseek_r1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "<think> is a special token" in proc.stderr
    assert "listening on" not in proc.stdout


def test_continuing_a_thought_starts_inside_it(r1_server) -> None:
    # The assistant message being continued opened the block: the output is reasoning at once.
    server, forced = r1_server
    messages = [*USER, {"role": "assistant", "content": "<think>\nSo"}]
    out = _client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        logit_bias=forced.bias, **PENALTIES,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    prompt = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\nSo"
    raw = _client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logit_bias=forced.bias,
        extra_body={"add_special_tokens": False}, **PENALTIES,
    ).choices[0].text  # fmt: skip
    reasoning, end, content = raw.partition("</think>")
    msg = out.choices[0].message
    assert msg.model_extra["reasoning_content"] == reasoning.lstrip()
    assert msg.content == (content.lstrip() if end else None)
