"""DraftPlanner: how many drafts each decode checks, from its own record and the step's price."""

from __future__ import annotations

import pytest

from tidal.config.scheduler import SchedulerConfig
from tidal.request import Request
from tidal.sampling_params import SamplingParams
from tidal.scheduler.drafting import DraftPlanner, _Record

PROMPT = [7, 1, 2, 3, 4, 5, 6]


def _planner(step_rows: float = 8.0) -> DraftPlanner:
    return DraftPlanner(
        SchedulerConfig(
            num_speculative_tokens=4, prompt_lookup_min=1, speculative_step_rows=step_rows
        )
    )


def _decoding(rid: str, outputs: tuple[int, ...] = (7,), max_tokens: int = 100) -> Request:
    """A request past its prefill whose latest token's KV is the next step's input."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    req = Request(rid, PROMPT, params, arrival_time_s=0.0)
    req.output_token_ids.extend(outputs)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def _step(planner: DraftPlanner, req: Request, model) -> list[int]:
    """Plan one decode; the model writes `model(proposal)`: the step appends the drafts that
    agree with it, then the model's next token (as ModelRunner._collect does)."""
    draft = planner.plan([req], spare=100).get(req.request_id, [])
    proposal = list(planner._pending.get(req.request_id, []))
    planner.scheduled(req, len(draft))
    wrote = model(proposal)
    kept = 0
    while kept < len(draft) and draft[kept] == wrote[kept]:
        kept += 1
    req.output_token_ids.extend(wrote[: kept + 1])
    req.num_computed_tokens = req.num_tokens - 1
    return draft


def _agrees(proposal: list[int]) -> list[int]:
    return [*proposal, proposal[-1] % 7 + 1]  # the prompt's cycle goes on


def _disagrees(proposal: list[int]) -> list[int]:
    return [proposal[0] % 7 + 1]  # another prompt token: its successor proposes again


def test_before_any_record_a_lone_decode_checks_two_and_a_batch_fewer() -> None:
    # Prior: half of proposals kept. Step price 8 rows. One decode: 1 token for 9 rows, and a
    # draft kept with p^j is worth a row while p^j >= tokens / rows: 0.5 (1/9), 0.25 (1.5/10),
    # not 0.125 (1.75/11). Four decodes: 0.5 >= 4/12 for each, 0.25 < 6/16 for none. Sixteen:
    # 0.5 < 16/24: none.
    planner = _planner()
    assert planner.plan([_decoding("a")], spare=100) == {"a": [1, 2]}
    four = [_decoding(r) for r in "abcd"]
    assert planner.plan(four, spare=100) == {r: [1] for r in "abcd"}
    sixteen = [_decoding(f"r{i}") for i in range(16)]
    assert planner.plan(sixteen, spare=100) == {}
    assert planner.plan(four, spare=2) == {"a": [1], "b": [1]}  # the spare budget, in order
    assert planner.plan(four, spare=-1) == {}  # a budget below the decodes: no drafts
    # 1 of 3 tokens out: the step may emit 2, one of them a draft (max_tokens' cap).
    assert planner.plan([_decoding("a", max_tokens=3)], spare=100) == {"a": [1]}


def test_guesses_that_come_true_earn_more_rows_and_ones_that_fail_lose_them() -> None:
    planner = _planner()
    req = _decoding("a")
    assert _step(planner, req, _agrees) == [1, 2]  # both kept: p = 3/4
    assert len(_step(planner, req, _agrees)) == 4  # all four kept
    # From here every guess is wrong: p = 6.8/7.8, 6.2/8.2, 5.7/8.6 (0.87, 0.76, 0.66).
    drafts = [_step(planner, req, _disagrees) for _ in range(30)]
    assert [len(d) for d in drafts[:3]] == [4, 4, 3]
    # At one decode a row costs 1/9 of the step: a guess keeps a row while it is right ~1 in 9
    # times, so a run of misses stops the drafts.
    assert drafts[-1] == []


def test_a_sequence_that_checks_nothing_still_learns_from_its_next_token() -> None:
    planner = _planner(step_rows=2.0)  # a lone decode's draft must be kept 1 time in 3
    req = _decoding("a")
    assert _step(planner, req, _disagrees) == [1]  # missed
    assert _step(planner, req, _agrees) == []  # p = 1/3: none
    # ... but its proposal came true (p = 2/3.9 with the miss decayed): it checks one again.
    assert len(_step(planner, req, _agrees)) == 1


def test_more_sequences_than_speculative_max_num_seqs_check_none_and_a_bad_price_is_refused() -> (
    None
):
    planner = DraftPlanner(
        SchedulerConfig(
            num_speculative_tokens=4,
            prompt_lookup_min=1,
            speculative_max_num_seqs=2,
            speculative_step_rows=1000.0,
        )
    )
    assert planner.plan([_decoding(r) for r in "abc"], spare=100) == {}
    assert len(planner.plan([_decoding(r) for r in "ab"], spare=100)) == 2
    with pytest.raises(ValueError, match="speculative_step_rows"):
        SchedulerConfig(speculative_step_rows=0)


def test_where_rows_come_in_blocks_a_full_batch_drafts_only_to_fill_the_next_block() -> None:
    # 16 decodes at an even chance, rows in blocks of 16 (AMX tiles) and a step price of 8: one
    # draft pays for a second tile's 15 padded rows too (16.5/32.5), and 16 drafts at 0.5 bring
    # 8 tokens for 16 rows (24/40); both < 16/24.
    config = SchedulerConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    sixteen = [_decoding(f"r{i}") for i in range(16)]
    assert DraftPlanner(config, row_block=16).plan(sixteen, spare=100) == {}
    # Twelve decodes at 3 in 4: 4 drafts fill the first block (15/24 > 12/20), 20 fill the
    # second (12 at 0.75 and 8 at 0.56: 25.5/40 > 15/24); a row past a block never pays.
    planner = DraftPlanner(config, row_block=16)
    for req in sixteen:
        planner._records[req.request_id] = _Record(kept=2.0)
    plan = planner.plan(sixteen[:12], spare=100)
    assert sorted(map(len, plan.values())) == [1] * 4 + [2] * 8
    # At better odds a second block pays (p = 0.95 after a run of kept drafts).
    for req in sixteen:
        planner._records[req.request_id] = _Record(kept=37.0, missed=1.0)
    plan = planner.plan(sixteen, spare=100)
    assert sum(map(len, plan.values())) >= 16
