"""A step's inputs round-trip through the one int64 tensor the ranks receive."""

from __future__ import annotations

import torch

from tidal.executor.step_message import pack_step, unpack_step
from tidal.worker.model_runner import StepInputs


def test_step_inputs_round_trip() -> None:
    inputs = StepInputs(
        input_ids=torch.tensor([7, 3, 9, 4, 4, 1]),
        positions=torch.tensor([12, 0, 1, 2, 3, 5]),
        num_tokens=[1, 4, 1],
        context_lens=[13, 4, 6],
        block_tables=[[[0, 0, 5, 6], [1, 2, 3, 4]], [[7], [8]], [[9, 10], [11, 12]]],
        sample_rows=[0, 4, 5],
        prompt_spans=[(1, 3), (5, 1)],
    )
    msg = pack_step(inputs)
    assert msg.dtype == torch.long and msg.dim() == 1
    back = unpack_step(msg)
    assert torch.equal(back.input_ids, inputs.input_ids)
    assert torch.equal(back.positions, inputs.positions)
    for name in ("num_tokens", "context_lens", "block_tables", "sample_rows", "prompt_spans"):
        assert getattr(back, name) == getattr(inputs, name), name


def test_an_empty_step_round_trips() -> None:
    inputs = StepInputs(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long),
                        [], [], [], [], [])  # fmt: skip
    back = unpack_step(pack_step(inputs))
    assert back.num_tokens == [] and back.block_tables == [] and back.input_ids.numel() == 0
