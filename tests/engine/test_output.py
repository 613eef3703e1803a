"""OutputState and StopChecker: stop strings across tokens, EOS, lengths, deltas, logprobs, metrics."""

from __future__ import annotations

import itertools
import random

from tests.engine.tokenizers_fixture import byte_level_bpe
from tidal.engine.output import Logprob, OutputState, StepDelta, make_logprobs
from tidal.engine.stop import StopChecker
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams

TOK = byte_level_bpe()
EOS = TOK.token_id("</s>")


def chars(text: str) -> list[int]:
    """One token per character, so a test controls exactly where token boundaries fall."""
    return [TOK.token_id({" ": "Ġ", "\n": "Ċ"}.get(c, c)) for c in text]


def state(max_model_len: int | None = None, prompt: str = "Hi", **kw: object) -> OutputState:
    params = SamplingParams(**{"max_tokens": None, **kw})  # type: ignore[arg-type]
    req = Request("r1", chars(prompt), params, 10.0, frozenset({EOS}), max_model_len=max_model_len)
    clock = itertools.count(100.0)
    return OutputState(req, TOK, prompt, clock=lambda: float(next(clock)))


def feed(st: OutputState, ids: list[int]) -> list[StepDelta]:
    return [st.append([t]) for t in ids]


def test_stop_string_split_across_tokens_is_never_emitted() -> None:
    st = state(stop=["STOP"])
    deltas = feed(st, chars("ab STOPcd"))
    streamed = "".join(d.new_text for d in deltas)
    assert streamed == "ab " and st.text == "ab "
    assert [d.new_text for d in deltas] == ["a", "b", " "] + [""] * 6
    assert [d.finish for d in deltas[5:7]] == [None, RequestStatus.FINISHED_STOPPED]
    assert deltas[6].stop_reason == "STOP" and deltas[8].new_token_ids == []
    assert st.token_ids == chars("ab STOP")  # tokens after the stop are not kept
    out = st.to_output()
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == "STOP" and out.outputs[0].text == "ab "


def test_a_partial_stop_string_is_released_once_it_cannot_match() -> None:
    st = state(stop=["STOP"])
    deltas = feed(st, chars("aSTx"))
    assert [d.new_text for d in deltas] == ["a", "", "", "STx"]
    assert not st.finished


def test_include_stop_str_in_output_keeps_the_stop_string_and_cuts_after_it() -> None:
    st = state(stop=["STOP"], include_stop_str_in_output=True)
    st.append(chars("ab "))
    delta = st.append(chars("STOPcd"))  # several tokens in one step
    assert delta.new_text == "STOP" and delta.new_token_ids == chars("STOP")
    assert st.text == "ab STOP" and st.stop_reason == "STOP"


def test_the_earliest_stop_string_wins() -> None:
    st = state(stop=["cd", "bcd e"])
    checker = st.stops
    match = checker.string_stop("xabcd ef", 8, 8)
    assert match is not None and match == (2, "bcd e")
    match = StopChecker(state(stop=["d e", "bc"]).request).string_stop("abcd e", 6, 6)
    assert match is not None and match == (1, "bc")


def test_eos_stops_unless_ignore_eos_and_its_text_is_not_output() -> None:
    st = state()
    delta = st.append(chars("ok") + [EOS] + chars("zz"))
    assert delta.finish is RequestStatus.FINISHED_STOPPED and delta.stop_reason is None
    assert st.token_ids == chars("ok") + [EOS] and st.text == "ok"
    st = state(ignore_eos=True, skip_special_tokens=False)
    delta = st.append(chars("ok") + [EOS] + chars("z"))
    assert delta.finish is None and st.text == "ok</s>z"


def test_stop_token_ids_report_the_token_as_stop_reason() -> None:
    stop_id = chars("!")[0]
    st = state(stop_token_ids=[stop_id])
    delta = st.append(chars("hi!ho"))
    assert delta.finish is RequestStatus.FINISHED_STOPPED and delta.stop_reason == stop_id
    assert st.text == "hi" and st.token_ids == chars("hi!")
    st = state(stop_token_ids=[stop_id], include_stop_str_in_output=True)
    st.append(chars("hi!ho"))
    assert st.text == "hi!"


def test_min_tokens_ignores_stops_until_reached() -> None:
    st = state(min_tokens=3, stop=["b"])
    st.append([EOS])  # output 1 < 3: EOS does not stop
    st.append(chars("b"))  # output 2 < 3: nor does a stop string
    assert not st.finished
    delta = st.append(chars("cb"))
    assert delta.finish is RequestStatus.FINISHED_STOPPED and st.text == "bc"
    st = state(min_tokens=2)
    st.append(chars("a"))
    assert st.append([EOS]).finish is RequestStatus.FINISHED_STOPPED  # the 2nd output may stop


def test_max_tokens_zero_keeps_nothing_and_one_keeps_one() -> None:
    st = state(max_tokens=0)
    delta = st.append(chars("a"))
    assert delta == StepDelta("", [], RequestStatus.FINISHED_LENGTH, None)
    assert st.to_output().outputs[0].token_ids == [] and st.to_output().outputs[0].text == ""
    st = state(max_tokens=1)
    delta = st.append(chars("ab"))
    assert delta == StepDelta("a", chars("a"), RequestStatus.FINISHED_LENGTH, None)
    st = state(max_tokens=2)
    assert st.append(chars("a")).finish is None
    assert st.append(chars("b")).finish is RequestStatus.FINISHED_LENGTH


def test_stop_wins_over_length_on_the_same_token() -> None:
    st = state(max_tokens=2)
    assert st.append(chars("a") + [EOS]).finish is RequestStatus.FINISHED_STOPPED


def test_context_limit_finishes_with_length() -> None:
    st = state(max_model_len=5, prompt="Hi")  # room for 3 outputs
    delta = st.append(chars("abcde"))
    assert delta.finish is RequestStatus.FINISHED_LENGTH and st.token_ids == chars("abc")


def test_length_finish_releases_held_back_text_and_incomplete_characters() -> None:
    st = state(max_tokens=3, stop=["xyz"])
    assert st.append(chars("ax")).new_text == "a"
    assert st.append(chars("y")) == StepDelta("xy", chars("y"), RequestStatus.FINISHED_LENGTH, None)
    emoji = TOK.encode("🙂")
    st = state(max_tokens=len(emoji) - 1)
    deltas = feed(st, emoji)
    assert [d.new_text for d in deltas[:-1]] == [""] * (len(emoji) - 2) + ["\ufffd"]
    assert st.to_output().outputs[0].text == TOK.decode(emoji[:-1])


def test_held_back_text_is_the_longest_tail_that_begins_a_stop_string() -> None:
    # Carried from step to step (KMP): the same answer as trying every tail, on growing texts
    # over small alphabets (where tails overlap most) and past whole matches.
    def longest_tail(text: str, stops: list[str]) -> int:
        return max(
            (
                k
                for s in stops
                for k in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:k])
            ),
            default=0,
        )

    rng = random.Random(0)
    for trial in range(3000):
        alphabet = "ab" if trial % 2 else "abc"
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 7))) for _ in range(rng.randint(1, 3))
        ]
        checker = StopChecker(state(stop=stops).request)
        text = ""
        for _ in range(rng.randint(1, 6)):
            text += "".join(rng.choices(alphabet, k=rng.randint(0, 4)))
            assert checker.held_back(text) == longest_tail(text, stops), (text, stops)
    assert (
        StopChecker(state(stop=["abc"], include_stop_str_in_output=True).request).held_back("ab")
        == 0
    )


def test_abort_releases_held_text() -> None:
    st = state(stop=["xyz"])
    st.append(chars("ax"))
    delta = st.finish(RequestStatus.FINISHED_ABORTED)
    assert delta == StepDelta("x", [], RequestStatus.FINISHED_ABORTED, None)
    assert st.to_output().outputs[0].finish_reason == "abort"


def test_delta_outputs_concatenate_to_the_final_output() -> None:
    st = state(stop=["\n\n"], logprobs=1)
    pieces: list[str] = []
    token_ids: list[int] = []
    for i, tid in enumerate(chars("one two three") + chars("\n\n")[:1] + chars("x")):
        entry = make_logprobs(tid, -0.5, 1, [tid], [-0.5], TOK)
        st.append([tid], [entry])
        if i % 3 == 0:
            out = st.to_output(delta=True)
            pieces.append(out.outputs[0].text)
            token_ids += out.outputs[0].token_ids
    st.finish(RequestStatus.FINISHED_ABORTED)
    last = st.to_output(delta=True)
    pieces.append(last.outputs[0].text)
    token_ids += last.outputs[0].token_ids
    full = st.to_output().outputs[0]
    assert "".join(pieces) == full.text == "one two three\nx"
    assert token_ids == full.token_ids
    assert full.cumulative_logprob == -0.5 * len(full.token_ids)
    assert full.logprobs is not None and len(full.logprobs) == len(full.token_ids)


def test_make_logprobs_has_the_chosen_token_and_ranked_alternatives() -> None:
    a, b, c = chars("abc")
    entry = make_logprobs(c, -3.0, 7, [a, b], [-0.1, -0.2], TOK)
    assert entry == {
        a: Logprob(-0.1, 1, "a"),
        b: Logprob(-0.2, 2, "b"),
        c: Logprob(-3.0, 7, "c"),
    }


def test_prompt_logprobs_start_with_none_and_metrics_use_the_clock() -> None:
    st = state(prompt_logprobs=1, max_tokens=1)
    st.add_prompt_logprobs([{5: Logprob(-1.0, 1, None)}])
    st.append(chars("a"))
    out = st.to_output()
    assert out.prompt_logprobs == [None, {5: Logprob(-1.0, 1, None)}]
    assert out.prompt == "Hi" and out.prompt_token_ids == chars("Hi")
    assert out.metrics is not None
    assert out.metrics.arrival_time_s == 10.0 and out.metrics.num_generation_tokens == 1
    assert out.metrics.last_token_time_s is not None and out.metrics.finished_time_s is not None
    assert state().to_output().prompt_logprobs is None
