"""rotary_tables: every layer type's cos/sin computed together equal each type's own."""

import pytest
import torch

from tidal.config.arch import RopeConfig
from tidal.layers.rotary import RotaryEmbedding, rotary_tables

GEMMA3 = {  # Gemma 3's two tables: a local base, and a global one with linear scaling
    "full_attention": RopeConfig(1_000_000.0, (("rope_type", "linear"), ("factor", 8.0))),
    "sliding_attention": RopeConfig(10_000.0),
}
YARN = RopeConfig(
    10_000.0,
    (("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 64)),
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [[7], [0, 1, 2, 3, 4], [5, 900, 31_000]])
def test_tables_together_equal_each_types_own(positions, dtype):
    rotary = {name: RotaryEmbedding(64, rope) for name, rope in {**GEMMA3, "yarn": YARN}.items()}
    assert rotary["yarn"].scale != 1.0  # the scaled branch runs
    pos = torch.tensor(positions)
    together = rotary_tables(rotary, pos, dtype)
    assert together.keys() == rotary.keys()
    for name, rot in rotary.items():
        cos, sin = rot(pos, dtype)
        assert torch.equal(together[name][0], cos) and torch.equal(together[name][1], sin)
        assert together[name][0].dtype == dtype and together[name][0].is_contiguous()


def test_tables_of_different_head_sizes_are_computed_one_by_one():
    rotary = {"a": RotaryEmbedding(64, GEMMA3["sliding_attention"]), "b": RotaryEmbedding(32, YARN)}
    pos = torch.arange(6)
    together = rotary_tables(rotary, pos, torch.float32)
    for name, rot in rotary.items():
        cos, sin = rot(pos, torch.float32)
        assert torch.equal(together[name][0], cos) and torch.equal(together[name][1], sin)
