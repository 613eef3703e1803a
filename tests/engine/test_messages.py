"""Every message between the API process and the engine process round-trips through pickle unchanged."""

from __future__ import annotations

import pickle
from dataclasses import fields

import pytest

from tidal.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    Heartbeat,
    RequestFailure,
    Shutdown,
    StepOutputs,
)
from tidal.engine.output import CompletionOutput, Logprob, RequestDelta, RequestMetrics
from tidal.engine.stats import StepStats
from tidal.sampling_params import SamplingParams, StructuredOutputs

_STATS = StepStats(
    num_scheduled_tokens=7, token_budget=64, batch_utilization=7 / 64, num_scheduled_seqs=2,
    num_decode_seqs=1, num_prefill_seqs=1, num_running=2, num_waiting=3, num_preempted=0,
    num_preemptions_total=1, kv_usage=0.25, num_free_blocks=12, prefix_queried_tokens=5,
    prefix_hit_tokens=4, prefix_queried_tokens_total=50, prefix_hit_tokens_total=40,
    evictions_by_reason=(("lru", 2), ("ttl", 0)), step_time_s=0.012, seat_utilization=2 / 32,
    seat_cap=32, prefill_budget=6, budget_reason="tpot", predicted_step_s=0.011,
    num_prefill_tokens=6, attended_keys=40, cost_coefficients=(0.01, 0.001, 0.004, 0.0005),
    headroom=0.9,
)  # fmt: skip
_OUTPUT = RequestDelta(
    request_id="cmpl-1-0",
    num_prompt_tokens=3,
    prompt_logprobs=[None, {40: Logprob(-1.5, 3, "H")}, {41: Logprob(-0.25, 1, "i")}],
    outputs=[
        CompletionOutput(
            index=0, text=" w1", token_ids=[90], cumulative_logprob=-0.5,
            logprobs=[{90: Logprob(-0.5, 1, " w1"), 91: Logprob(-2.0, 2, " w2")}],
            finish_reason="length", stop_reason=None,
        )
    ],
    finished=True,
    metrics=RequestMetrics(1.0, 1.1, 1.2, 1.2, 1.3, 3, 1, 0, 0),
    num_cached_tokens=0,
    last_token_time_s=1.2,
)  # fmt: skip

MESSAGES = [
    AddRequest(
        "cmpl-1-0",
        [2, 40, 41],
        SamplingParams(temperature=0.0, max_tokens=5, stop=["x"], logprobs=2, seed=7),
        prompt="Hi",
        priority=-1,
        session_id="s1",
        timeout_s=2.5,
        queue_timeout_s=0.5,
    ),
    AddRequest("r", [1], SamplingParams()),
    AddRequest(
        "c",
        [1],
        SamplingParams(structured_outputs=StructuredOutputs("json", '{"type": "object"}')),
    ),
    AbortRequest("cmpl-1-0"),
    Shutdown(),
    EngineReady(
        pid=123,
        incarnation=2,
        max_model_len=256,
        vocab_size=128,
        num_blocks=512,
        load_time_s=0.5,
        device_type="cpu",
        device_memory_bytes=None,
    ),  # fmt: skip
    StepOutputs(
        outputs=[_OUTPUT],
        failures=[RequestFailure("r2", "queue_full", "the waiting queue is full")],
        stats=_STATS,
        num_steps=41,
    ),
    StepOutputs(),
    Heartbeat(num_steps=41, num_unfinished=3),
    EngineFailed("config", "model.path='x' is invalid"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trips(msg: object) -> None:
    back = pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(back) is type(msg)
    assert back == msg
    # Slots keep messages small and catch a misspelled field at construction.
    assert not hasattr(back, "__dict__")
    for f in fields(msg):  # type: ignore[arg-type]
        assert getattr(back, f.name) == getattr(msg, f.name), f.name


def test_every_message_type_is_covered() -> None:
    from tidal.engine import messages

    declared = {
        name
        for name, obj in vars(messages).items()
        if isinstance(obj, type) and obj.__module__ == messages.__name__
    }
    assert declared == {type(m).__name__ for m in MESSAGES} | {"RequestFailure"}
