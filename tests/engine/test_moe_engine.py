"""DeepSeek-V3 (MLA + MoE) through the whole engine (tidal.LLM): the KV pool holds latents
((kv_lora_rank + rope dim) per token and layer), and a request's greedy tokens are transformers'
alone, batched with others, chunked, and on a prefix-cache hit; an 8-bit latent cache runs too."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.tiny import TINY_VOCAB, make_tiny_model_dir
from tests.kv.pool_check import assert_pool_clean
from tidal import LLM, SamplingParams
from tidal.config.arch import arch_from_hf
from tidal.kv.layout import KVLayout
from tidal.layers.moe import SparseMoE

MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(n: int, shared_prefix: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(shared_prefix)]
    return [
        [1] + prefix + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(2, 20))]
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_deepseek_v3"), "deepseek_v3")


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' greedy tokens for each prompt."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(6, shared_prefix=16)
    outs = []
    with torch.no_grad():
        for p in prompts:
            gen = hf.generate(
                torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
            outs.append(gen[0, len(p) :].tolist())
    return prompts, outs


def test_kv_pool_holds_latents(model_dir):
    llm = LLM(str(model_dir), kv_cache_bytes=1 << 20, block_size=8)
    arch, layout = llm.engine.loaded.arch, llm.engine.layout
    assert arch.mla is not None
    latent = arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
    assert layout.bytes_per_token == latent * arch.num_layers * 4  # float32
    mla = arch.mla
    expanded = arch.num_layers * arch.num_heads * (
        mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim
    ) * 4  # fmt: skip
    print(f"latent {layout.bytes_per_token} B/token, expanded K/V {expanded} B/token")
    assert layout.bytes_per_token < expanded
    assert llm.engine.num_blocks == (1 << 20) // (8 * latent * arch.num_layers * 4)
    pool = llm.engine.runner.kv_caches[0]
    assert isinstance(pool, torch.Tensor) and pool.shape[-2:] == (1, latent)


def test_deepseek_v3_kv_bytes_per_token():
    """The real DeepSeek-V3 config's figures: 70,272 B per token in bfloat16 against 4.77 MiB
    for expanded K and V (docs/models.md)."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "rope_scaling": {
            "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
    }  # fmt: skip
    arch = arch_from_hf(cfg)
    layout = KVLayout.from_layer_windows(
        arch.layer_windows(), block_size=16, num_kv_heads=arch.kv_cache_heads,
        head_dim=arch.kv_cache_head_dim, dtype_bytes=2, parts=arch.kv_cache_parts,
    )  # fmt: skip
    assert layout.bytes_per_token == (512 + 64) * 61 * 2 == 70_272
    expanded = 61 * 128 * ((128 + 64) + 128) * 2
    assert expanded == 4_997_120 and expanded // layout.bytes_per_token == 71
    assert arch.moe_layers == tuple(range(3, 61)) and arch.moe.score_bias
    assert arch.rope["full_attention"].scaling_dict()["rope_type"] == "yarn"
    int8 = KVLayout.from_layer_windows(
        arch.layer_windows(), block_size=16, num_kv_heads=1, head_dim=576, dtype_bytes=2,
        kv_dtype="int8", parts=1,
    )  # fmt: skip
    assert int8.bytes_per_token == (576 + 4) * 61 == 35_380


def test_deepseek_v2_lite_kv_bytes_per_token():
    """DeepSeek-V2-Lite (no q_lora, 16 heads): 31,104 B per token against 276,480 B expanded."""
    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "topk_method": "greedy",
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
    }  # fmt: skip
    arch = arch_from_hf(cfg)
    assert arch.mla.q_lora_rank is None and arch.moe.scoring == "softmax"
    layout = KVLayout.from_layer_windows(
        arch.layer_windows(), block_size=16, num_kv_heads=arch.kv_cache_heads,
        head_dim=arch.kv_cache_head_dim, dtype_bytes=2, parts=arch.kv_cache_parts,
    )  # fmt: skip
    assert layout.bytes_per_token == 576 * 27 * 2 == 31_104
    assert 27 * 16 * ((128 + 64) + 128) * 2 == 276_480


# One page of the tiny model: 8 tokens x 3 layers x (16 + 8) latent values x 4 B = 2,304 B.
@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("batched", dict(kv_cache_bytes=1 << 20, max_num_seqs=8, max_num_batched_tokens=512)),
        ("chunked", dict(kv_cache_bytes=1 << 20, max_num_seqs=8, max_num_batched_tokens=10)),
        # ~15 usable pages for 6 requests of up to 6 pages each: some are preempted
        ("preempted", dict(kv_cache_bytes=16 * 2304, max_num_seqs=8)),
    ],
)
def test_greedy_matches_transformers_alone_and_batched(model_dir, reference, name, kwargs):
    prompts, expected = reference
    llm = LLM(str(model_dir), block_size=8, **kwargs)
    # One request first (its full blocks are cached), then all of them: the rest hit its prefix.
    first = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=PARAMS)[0]
    assert list(first.outputs[0].token_ids) == expected[0]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    for i, out in enumerate(outs):
        assert list(out.outputs[0].token_ids) == expected[i], (name, i)
    assert llm.engine.kv.prefix_hit_tokens >= 16 * (len(prompts) - 1)  # two full pages each
    if name == "preempted":
        assert llm.engine.last_stats.num_preemptions_total > 0
    assert_pool_clean(llm.engine.kv)


@pytest.mark.parametrize(
    ("kv_dtype", "value_bytes", "scale_bytes"), [("int8", 1, 4), ("bfloat16", 2, 0)]
)
def test_latent_cache_in_fewer_bits_runs(model_dir, reference, kv_dtype, value_bytes, scale_bytes):
    """8-bit pages hold the latent with one float32 scale per token, (rank + rope + 4) bytes per
    layer; bfloat16 pages under float32 compute 2 bytes a value, read back widened."""
    prompts, expected = reference
    llm = LLM(
        str(model_dir), kv_cache_bytes=1 << 20, block_size=8, kv_cache_dtype=kv_dtype,
        quantization_gate=False,
    )  # fmt: skip
    arch, layout = llm.engine.loaded.arch, llm.engine.layout
    latent = arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
    assert layout.bytes_per_token == (latent * value_bytes + scale_bytes) * arch.num_layers
    outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=PARAMS)
    for out in outs:
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
    # The first token comes from the prompt's last position, where the rounding of a random
    # tiny model's latents is far below the gap between its top two logits.
    assert [o.outputs[0].token_ids[0] for o in outs] == [e[0] for e in expected[:2]]


def test_moe_output_does_not_depend_on_the_batch(model_dir):
    """A token's routed experts are the same alone and among 40 other tokens, and its output
    differs only by the float32 rounding of a matmul over a different number of rows (as a
    dense MLP's does): routing is per token, with no capacity limit to drop tokens."""
    llm = LLM(str(model_dir), kv_cache_bytes=1 << 20, block_size=8)
    moe = next(m for m in llm.engine.loaded.model.modules() if isinstance(m, SparseMoE))
    torch.manual_seed(0)
    x = torch.randn(41, moe.gate.weight.shape[1])
    with torch.no_grad():
        together = moe(x)
        counts = moe.last_expert_tokens
        alone = torch.cat([moe(x[i : i + 1]) for i in range(x.shape[0])])
        _, ids_together = moe.gate(x)
        ids_alone = torch.cat([moe.gate(x[i : i + 1])[1] for i in range(x.shape[0])])
    assert int(counts.sum()) == 41 * moe.gate.moe.top_k
    assert torch.equal(ids_together.sort(dim=-1)[0], ids_alone.sort(dim=-1)[0])
    print(f"max|alone - batched| = {(together - alone).abs().max().item():.2e}")
    assert torch.allclose(together, alone, atol=1e-5, rtol=1e-5)


def test_expert_load_reaches_step_stats_and_metrics(model_dir):
    """Each step's tokens per expert (summed over the sparse layers) are in StepStats, and
    /metrics' histogram gets one observation per expert per step."""
    from prometheus_client import generate_latest

    from tidal.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    llm = LLM(str(model_dir), kv_cache_bytes=1 << 20, block_size=8)
    core = llm.engine
    arch = core.loaded.arch
    prompt = [1, 40, 41, 42, 43, 44]
    core.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    steps = 0
    while core.has_unfinished():
        core.step()
        stats = core.last_stats
        if stats.num_scheduled_tokens:
            steps += 1
            load = stats.moe_expert_tokens
            assert len(load) == arch.moe.num_experts
            # every scheduled token picks top_k experts in each sparse layer
            assert sum(load) == stats.num_scheduled_tokens * arch.moe.top_k * len(arch.moe_layers)
            metrics.on_step(stats)
    text = generate_latest(metrics.registry).decode()
    count = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("tidal:moe_expert_tokens_count")
    )
    assert steps == 3 and count == steps * arch.moe.num_experts
    assert "tidal:moe_expert_load_imbalance " in text


def test_tensor_parallel_is_refused_for_mla_and_moe(model_dir):
    from tidal.loader.arch_reader import read_arch_config
    from tidal.models.registry import check_tensor_parallel

    arch = read_arch_config(model_dir)
    check_tensor_parallel(arch, 1)
    with pytest.raises(ValueError, match="tensor_parallel=2 is not supported for the deepseek_v3"):
        check_tensor_parallel(arch, 2)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_latent_decode_reads_the_pages_in_place_in_c(model_dir, kv_dtype):
    """Decode rows attend through the C paged-attention kernel (one KV head of latents, values
    the same rows) with the pages read in place, for float, bfloat16 and 8-bit pages: every
    decode step calls it once a layer, and each step's logprobs match torch's gather-and-widen
    path to float32 rounding."""
    import tidal.attention.mla_paged as mla_paged
    from tidal.kernels import paged_attention

    if not paged_attention.available():
        pytest.skip("the C paged-attention kernel is not built here")
    llm = LLM(str(model_dir), kv_cache_bytes=1 << 20, block_size=8, kv_cache_dtype=kv_dtype,
              quantization_gate=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = _prompts(3, shared_prefix=0)
    calls = []
    original = mla_paged._kernel_decode

    def counted(*args):
        out = original(*args)
        calls.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_paged, "_kernel_decode", counted)
        in_c = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    layers = llm.engine.loaded.arch.num_layers
    assert calls and all(calls) and len(calls) == 5 * layers  # 5 decode steps, each a call a layer
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_paged, "_kernel_decode", lambda *args: None)
        in_torch = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for a, b in zip(in_c, in_torch, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for token, lp in step_a.items():
                assert lp.logprob == pytest.approx(step_b[token].logprob, abs=1e-4)
