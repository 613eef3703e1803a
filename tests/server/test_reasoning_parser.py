"""Reasoning parsers over token-by-token streams: every split point of the tags, no closing tag,
a pre-filled tag, tags in the prompt, empty reasoning; token counting; choosing a parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tests.loader.test_real_gguf import metadata_gguf  # noqa: F401 (a fixture, used below)
from tidal.config.server import REASONING_PARSERS, ServerConfig
from tidal.loader.chat_template import builtin_chat_template
from tidal.loader.tokenizer import Tokenizer, load_tokenizer
from tidal.server.reasoning import (
    END_TAG,
    REASONS_BY_DEFAULT,
    START_TAG,
    ReasoningParser,
    generation_prefix,
    resolve_reasoning_parser,
    split_output,
)

R1 = ReasoningParser("deepseek_r1", True, (1,), (2,))
QWEN3 = ReasoningParser("qwen3", False, (1,), (2,))


def _stream(parser: ReasoningParser, pieces: list[str], in_reasoning: bool):
    """(reasoning, content) from a stream fed piece by piece; None for a part never started."""
    splitter = parser.splitter(in_reasoning)
    reasoning, content = [], []
    for piece in pieces:
        out = splitter.feed(piece)
        reasoning.append(out.reasoning)
        content.append(out.content)
    last = splitter.finish()
    reasoning.append(last.reasoning)
    content.append(last.content)
    r = "".join(reasoning) if splitter.reasoning_started else None
    c = "".join(content) if splitter.content_started else None
    return r, c


def _cuts(text: str) -> list[list[str]]:
    """The text cut at every pair of points: every way a tag can fall across three pieces."""
    out = []
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            out.append([text[:i], text[i:j], text[j:]])
    return out


@pytest.mark.parametrize(
    ("text", "in_reasoning", "reasoning", "content"),
    [
        # R1 distills: the prompt ends with "<think>\n", so the output starts inside the block.
        ("Add them.\n</think>\n\nIt is 4.", True, "Add them.\n", "It is 4."),
        # Older R1 templates: the model writes the opening tag itself.
        ("<think>\nAdd them.</think>It is 4.", True, "Add them.", "It is 4."),
        # Qwen3 thinking on its own: the output opens the block.
        ("<think>\nAdd them.</think>\n\nIt is 4.", False, "Add them.", "It is 4."),
        # Empty reasoning (Qwen3 and R1 both write it when there is nothing to think about).
        ("<think>\n\n</think>\n\nIt is 4.", False, "", "It is 4."),
        ("\n</think>\n\nIt is 4.", True, "", "It is 4."),
        # After the end tag everything is answer, tags included.
        ("a</think>b<think>c</think>d", True, "a", "b<think>c</think>d"),
        # A "<" that is no tag is text.
        (
            "1 < 2 and </thinking> is no tag</think>ok",
            True,
            "1 < 2 and </thinking> is no tag",
            "ok",
        ),
    ],
)
def test_every_split_point_gives_the_whole_output_split(
    text: str, in_reasoning: bool, reasoning: str, content: str
) -> None:
    whole = split_output(R1 if in_reasoning else QWEN3, text, in_reasoning)
    assert (whole.reasoning_content, whole.content) == (reasoning, content)
    for parser in (R1, QWEN3):
        for pieces in _cuts(text):
            got = _stream(parser, pieces, in_reasoning)
            assert got == (reasoning, content), pieces


def test_character_by_character_never_shows_a_partial_tag() -> None:
    text = "Add them.</think>\n\nIt is 4."
    splitter = R1.splitter(True)
    shown = []
    for ch in text:
        out = splitter.feed(ch)
        shown += [out.reasoning, out.content]
    last = splitter.finish()
    shown += [last.reasoning, last.content]
    assert "".join(shown) == "Add them.It is 4."
    assert not any("<" in s for s in shown)  # the tag's characters were held, then dropped


def test_no_closing_tag_is_all_reasoning_and_no_content() -> None:
    text = "Let me see. 2 + 2 < 5 so"  # cut off by max_tokens
    for pieces in _cuts(text):
        assert _stream(R1, pieces, True) == (text, None)
    # qwen3 without a leading <think>: the model answered without thinking.
    assert _stream(QWEN3, [text], False) == (None, text)
    # ... and cut off inside a block it opened: all reasoning.
    assert _stream(QWEN3, ["<think>", "\nhm"], False) == ("hm", None)
    # held-back text that turned out to be no tag comes out at the end.
    assert _stream(R1, ["thinking </thi"], True) == ("thinking </thi", None)


def test_a_start_tag_after_the_answer_began_is_answer_text() -> None:
    assert _stream(QWEN3, ["Sure: <think>", " is a tag"], False) == (
        None,
        "Sure: <think> is a tag",
    )


def test_the_prompt_decides_where_the_output_starts() -> None:
    assert R1.starts_in_reasoning("<｜Assistant｜><think>\n") is True
    assert QWEN3.starts_in_reasoning("<｜Assistant｜><think>\n") is True
    # Qwen3 with enable_thinking false closes an empty block in the prompt.
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert R1.starts_in_reasoning(closed) is False
    assert QWEN3.starts_in_reasoning(closed) is False
    # No tag there, or not known: the parser's own default.
    for prefix in ("<|im_start|>assistant\n", None):
        assert R1.starts_in_reasoning(prefix) is True
        assert QWEN3.starts_in_reasoning(prefix) is False


_QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def _render(template: str):
    from tidal.loader.chat_template import render_chat_template

    def render(messages, add_generation_prompt: bool, **kw):
        return render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>", **kw
        )

    return render


def test_tags_in_the_user_message_do_not_move_the_start() -> None:
    # The prefix is what the template writes after the last message, never the messages.
    user = [{"role": "user", "content": "what do <think> and </think> mean?"}]
    r1 = generation_prefix(
        _render(builtin_chat_template("deepseek_r1")),
        user,
        add_generation_prompt=True,
        continue_final_message=False,
        template_kwargs={},
    )
    assert r1 == "<｜Assistant｜><think>\n"
    qwen = _render(_QWEN_LIKE)
    on = generation_prefix(
        qwen, user, add_generation_prompt=True, continue_final_message=False, template_kwargs={}
    )
    off = generation_prefix(
        qwen,
        user,
        add_generation_prompt=True,
        continue_final_message=False,
        template_kwargs={"enable_thinking": False},
    )
    assert (QWEN3.starts_in_reasoning(on), QWEN3.starts_in_reasoning(off)) == (False, False)
    assert off == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # Continuing an assistant message: its own text decides.
    cont = [*user, {"role": "assistant", "content": "<think>\nThey are"}]
    prefix = generation_prefix(
        qwen, cont, add_generation_prompt=False, continue_final_message=True, template_kwargs={}
    )
    assert QWEN3.starts_in_reasoning(prefix) is True


def _decode_spaces(ids: list[int]) -> str:
    return "".join(" " if i == 9 else "x" for i in ids)  # id 9 is whitespace, others are text


def test_reasoning_tokens_are_the_ids_between_the_tags() -> None:
    # R1 with the tag pre-filled: 3 reasoning ids, then </think> (2), then the answer.
    assert R1.count_reasoning_tokens([5, 6, 7, 2, 9, 8], True, _decode_spaces) == 3
    # The model wrote <think> (1) after whitespace: neither it nor the whitespace count.
    assert R1.count_reasoning_tokens([9, 1, 5, 6, 2, 8], True, _decode_spaces) == 2
    assert QWEN3.count_reasoning_tokens([1, 5, 2, 8, 8], False, _decode_spaces) == 1
    # No end tag: everything after the start is reasoning.
    assert R1.count_reasoning_tokens([5, 6, 7], True, _decode_spaces) == 3
    # Empty reasoning; an answer without a block; a <think> inside the answer.
    assert R1.count_reasoning_tokens([2, 8], True, _decode_spaces) == 0
    assert QWEN3.count_reasoning_tokens([8, 8], False, _decode_spaces) == 0
    assert QWEN3.count_reasoning_tokens([8, 1, 5, 2], False, _decode_spaces) == 0
    # Tags that take several ids in this vocabulary.
    multi = ReasoningParser("deepseek_r1", True, (1, 3), (2, 4))
    assert multi.count_reasoning_tokens([1, 3, 5, 6, 2, 4, 8], True, _decode_spaces) == 2


def _tokenizer(template: str | None, special_tags: bool = False) -> Tokenizer:
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *chars])}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<s>", "</s>")])
    hf.add_tokens([AddedToken(t, special=special_tags) for t in (START_TAG, END_TAG)])
    return Tokenizer(
        hf,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        add_bos_token=False,
        chat_template=template,
    )


def test_auto_picks_the_parser_from_the_chat_template() -> None:
    assert set(REASONS_BY_DEFAULT) | {"auto", "none"} == set(REASONING_PARSERS)
    r1 = resolve_reasoning_parser("auto", _tokenizer(builtin_chat_template("deepseek_r1")))
    assert r1 is not None and r1.name == "deepseek_r1" and r1.reasons_by_default
    tok = _tokenizer(_QWEN_LIKE + "<think>")
    qwen = resolve_reasoning_parser("auto", tok)
    assert qwen is not None and qwen.name == "qwen3" and not qwen.reasons_by_default
    # The tags' ids in this vocabulary, one each.
    assert (qwen.start_ids, qwen.end_ids) == (
        (tok.token_to_id(START_TAG),),
        (tok.token_to_id(END_TAG),),
    )
    # The first R1 templates name only </think>, to strip it from earlier answers.
    strips = "{% for m in messages %}{{ m.content.split('</think>')[-1] }}{% endfor %}"
    first_r1 = resolve_reasoning_parser("auto", _tokenizer(strips))
    assert first_r1 is not None and first_r1.name == "deepseek_r1"
    assert resolve_reasoning_parser("auto", _tokenizer(builtin_chat_template("chatml"))) is None
    assert resolve_reasoning_parser("auto", _tokenizer(None)) is None
    assert (
        resolve_reasoning_parser("none", _tokenizer(builtin_chat_template("deepseek_r1"))) is None
    )
    # Named outright, a parser applies whatever the template says.
    named = resolve_reasoning_parser("deepseek_r1", _tokenizer(builtin_chat_template("chatml")))
    assert named is not None and named.name == "deepseek_r1"


def test_tags_that_detokenizing_drops_are_refused_or_skipped() -> None:
    tok = _tokenizer(builtin_chat_template("deepseek_r1"), special_tags=True)
    with pytest.raises(ValueError, match="<think> is a special token"):
        resolve_reasoning_parser("deepseek_r1", tok)
    assert resolve_reasoning_parser("auto", tok) is None


def test_the_parser_is_set_from_the_file_the_environment_or_the_flag(tmp_path: Path) -> None:
    import argparse

    from tidal.config.loader import add_cli_arguments, cli_overrides_from_args, load_config

    assert load_config(None, {}, {}).server.reasoning_parser == "auto"
    yaml_file = tmp_path / "tidal.yaml"
    yaml_file.write_text("server:\n  reasoning_parser: qwen3\n")
    assert load_config(str(yaml_file), {}, {}).server.reasoning_parser == "qwen3"
    env = {"TIDAL_SERVER_REASONING_PARSER": "none"}
    assert load_config(str(yaml_file), env, {}).server.reasoning_parser == "none"
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    flags = cli_overrides_from_args(parser.parse_args(["--reasoning-parser", "deepseek_r1"]))
    assert load_config(str(yaml_file), env, flags).server.reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="server.reasoning_parser"):
        load_config(None, {"TIDAL_SERVER_REASONING_PARSER": "r1"}, {})


def test_a_bad_parser_name_is_refused_with_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError, match="reasoning_parser.*deepseek_r1"):
        ServerConfig(reasoning_parser="r1")
    with pytest.raises(ValueError, match="expected one of auto, none, deepseek_r1, qwen3"):
        resolve_reasoning_parser("r1", _tokenizer(None))


def _deepseek_hf_dir(root: Path, model_type: str, tcfg: dict) -> Path:
    tokens = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
    vocab = {t: i for i, t in enumerate([*tokens, "h", "i", START_TAG, END_TAG])}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="h"))
    hf.add_special_tokens([AddedToken(t, special=True) for t in tokens])
    hf.add_tokens([AddedToken(t, special=False) for t in (START_TAG, END_TAG)])
    root.mkdir()
    hf.save(str(root / "tokenizer.json"))
    config = {"bos_token": tokens[0], "eos_token": tokens[1], **tcfg}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def test_r1_distills_without_a_template_get_the_built_in_r1_one(tmp_path: Path) -> None:
    # A Qwen2-architecture distill: DeepSeek's vocabulary decides, not the model type.
    for arch in ("qwen2", "llama", "deepseek_v3"):
        root = _deepseek_hf_dir(tmp_path / arch, arch, {})
        for family in (None, arch):
            tok = load_tokenizer(root, family)
            assert tok.family == "deepseek_r1"
            assert tok.chat_template == builtin_chat_template("deepseek_r1")
            assert tok.eos_token_id in tok.eos_token_ids
    # The checkpoint's own template wins over the built-in one.
    own = _deepseek_hf_dir(tmp_path / "own", "qwen2", {"chat_template": "{{ 'mine' }}"})
    assert load_tokenizer(own).chat_template == "{{ 'mine' }}"
    # A chat family named outright wins over the vocabulary.
    assert load_tokenizer(own, "chatml").family == "chatml"


def test_the_built_in_r1_template_renders_what_deepseeks_does() -> None:
    render = _render(builtin_chat_template("deepseek_r1"))
    bos = "<s>"
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "2+2?"},
    ]
    assert render(chat, add_generation_prompt=True) == (
        f"{bos}Be brief.<｜User｜>Hi<｜Assistant｜>\n\nHello!<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜><think>\n"
    )
    assert render(chat, add_generation_prompt=False).endswith("<｜User｜>2+2?")
    # Two system messages are joined by a blank line; reasoning_content is never replayed.
    two = [
        {"role": "system", "content": "A."},
        {"role": "system", "content": "B."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo", "reasoning_content": "secret"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(two, add_generation_prompt=True) == (
        f"{bos}A.\n\nB.<｜User｜>Hi<｜Assistant｜>Yo<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜><think>\n"
    )
    # A tool round: the call, its outputs, then the answer goes on without a new header.
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    tools = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "5C"},
    ]
    assert render(tools, add_generation_prompt=True) == (
        f"{bos}<｜User｜>Weather?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>weather\n```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>"
        "<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>5C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )


@pytest.mark.slow  # the real file's header comes from the package index once (then a cache)
def test_a_real_r1_distill_gets_the_r1_parser(metadata_gguf: Path) -> None:  # noqa: F811
    """DeepSeek-R1-Distill-Qwen 7B's own tokenizer and template: its generation prompt ends at
    "<｜Assistant｜>" (the model writes "<think>" itself), its tags are one plain id each."""
    tok = load_tokenizer(metadata_gguf, "qwen2")
    parser = resolve_reasoning_parser("auto", tok)
    assert parser is not None and parser.name == "deepseek_r1"
    assert len(parser.start_ids) == len(parser.end_ids) == 1
    prefix = generation_prefix(
        tok.apply_chat_template,
        [{"role": "user", "content": "2+2?"}],
        add_generation_prompt=True,
        continue_final_message=False,
        template_kwargs={},
    )
    assert prefix == "<｜Assistant｜>" and parser.starts_in_reasoning(prefix)
    output = "<think>\nTwo and two make 4.\n</think>\n\nThe answer is **4**."
    ids = tok.encode(output, add_special_tokens=False)
    splitter = parser.splitter(True)
    reasoning, content = [], []
    for i in range(len(ids)):  # one token at a time, as the engine's detokenizer sends them
        piece = tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])) :]
        out = splitter.feed(piece)
        reasoning.append(out.reasoning)
        content.append(out.content)
    assert "".join(reasoning) == "Two and two make 4.\n"
    assert "".join(content) == "The answer is **4**."
    thought = tok.encode("\nTwo and two make 4.\n", add_special_tokens=False)
    assert parser.count_reasoning_tokens(ids, True, tok.decode) == len(thought)
