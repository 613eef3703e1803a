"""MoE GGUFs written with the gguf writer in llama.cpp's conventions load and match transformers:
a tiny DeepSeek-V3 as `deepseek2` (its key and tensor names, experts stacked, kv_b split into
attn_k_b / attn_v_b as newer converters do, or kept whole; Q8_0 experts served from their blocks
match the dequantized file), Qwen3-MoE as `qwen3moe` and Mixtral as `llama` with experts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.paged import paged_prefill_and_greedy
from tests.models.tiny_hf import tiny_config
from tidal.loader.model_loader import load_model
from tidal.quant.gguf_blocks import GGUFLinear

PROMPTS = [[5, 17, 33], [9, 2, 77, 41, 100, 3, 8, 64, 12]]
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def _tiny_v3():
    """transformers' tiny DeepSeek-V3 (tests/models/tiny_hf.py) with mscale == mscale_all_dim,
    the one YaRN form a GGUF can state (its log multiplier)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tiny_config("deepseek_v3")
    cfg.rope_parameters = {**cfg.rope_parameters, "mscale": 0.8, "mscale_all_dim": 0.8}
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.2) if "norm" in name else p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def write_deepseek2_gguf(model, path: Path, split_kv_b: bool, q8_experts: bool = False) -> None:
    import gguf

    cfg = model.config
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)  # the MQA form: one latent head
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    w.add_tensor("output.weight", state["lm_head.weight"].numpy())
    heads, nope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for ours, theirs in _NAMES.items():
            if pre + ours in state:
                a = state[pre + ours].numpy()
                if q8_experts and a.ndim == 2 and a.shape[1] % 32 == 0:  # Q8_0: 32-wide blocks
                    q8 = gguf.GGMLQuantizationType.Q8_0
                    w.add_tensor(f"blk.{i}.{theirs}", gguf.quants.quantize(a, q8), raw_dtype=q8)
                else:
                    w.add_tensor(f"blk.{i}.{theirs}", a)
        kv_b = state[pre + "self_attn.kv_b_proj.weight"]
        if split_kv_b:  # llama.cpp: k_b transposed to (H, rank, nope), v_b (H, v, rank)
            kv = kv_b.view(heads, nope + v_dim, -1)
            k_b, v_b = kv[:, :nope].transpose(1, 2), kv[:, nope:]
            w.add_tensor(f"blk.{i}.attn_k_b.weight", k_b.contiguous().numpy())
            w.add_tensor(f"blk.{i}.attn_v_b.weight", v_b.contiguous().numpy())
        else:
            w.add_tensor(f"blk.{i}.attn_kv_b.weight", kv_b.numpy())
        if pre + "mlp.experts.down_proj" not in state:
            continue
        # transformers holds the experts stacked: gate_up (E, 2I, H), down (E, H, I)
        gate, up = state[pre + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
        experts = {
            "gate_proj": gate,
            "up_proj": up,
            "down_proj": state[pre + "mlp.experts.down_proj"],
        }
        for proj, theirs in _EXPERT.items():
            stacked = experts[proj].contiguous().numpy()  # (E, rows, cols)
            if q8_experts:
                q = gguf.quants.quantize(stacked, gguf.GGMLQuantizationType.Q8_0)
                w.add_tensor(
                    f"blk.{i}.{theirs}.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0
                )
            else:
                w.add_tensor(f"blk.{i}.{theirs}.weight", np.ascontiguousarray(stacked))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_model():
    model = _tiny_v3()
    with torch.no_grad():
        refs = [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    return model, refs


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_deepseek2_gguf_matches_transformers(hf_model, tmp_path, split_kv_b):
    model, refs = hf_model
    path = tmp_path / "tiny-deepseek2.gguf"
    write_deepseek2_gguf(model, path, split_kv_b)
    loaded = load_model(path, torch.float32, weight_cache=False)
    arch = loaded.arch
    assert arch.mla is not None and arch.mla.kv_lora_rank == model.config.kv_lora_rank
    assert arch.moe is not None and arch.moe.score_bias and arch.moe.num_groups == 4
    assert arch.moe_layers == (1, 2)
    logits, _ = paged_prefill_and_greedy(loaded.model, arch, PROMPTS, max_new=1, chunk=4)
    for ours, ref in zip(logits, refs):
        diff = (ours - ref).abs().max().item()
        print(f"deepseek2 GGUF split_kv_b={split_kv_b}: max|diff|={diff:.2e}")
        assert diff < 1e-4


def test_deepseek2_q8_experts_run_from_their_blocks(hf_model, tmp_path):
    """Q8_0 experts served from the file's blocks (each expert a GGUFLinear over its rows of the
    stacked tensor), with the Q8_0 MLA down-projections (q_a_proj, kv_a_proj_with_mqa) and dense
    MLP as blocks too, give the logits of the same file dequantized to float, and 8 greedy
    tokens. (The tiny config's other matrices are narrower than a 32-value Q8_0 block.)"""
    model, _ = hf_model
    path = tmp_path / "tiny-deepseek2-q8.gguf"
    write_deepseek2_gguf(model, path, split_kv_b=True, q8_experts=True)
    blocks = load_model(path, torch.float32, gguf_blocks=True)
    dense = load_model(path, torch.float32, weight_cache=False)
    expert = blocks.model.model.layers[1].mlp.experts[3]
    assert isinstance(expert.gate_up_proj, GGUFLinear) and isinstance(expert.down_proj, GGUFLinear)
    attn = blocks.model.model.layers[0].self_attn  # q_a_proj and kv_a_proj_with_mqa, joined
    assert isinstance(attn.x_proj, GGUFLinear) and len(attn.x_proj.parts) == 2
    ours, out = paged_prefill_and_greedy(blocks.model, blocks.arch, PROMPTS, max_new=8)
    ref, ref_out = paged_prefill_and_greedy(dense.model, dense.arch, PROMPTS, max_new=8)
    for a, b in zip(ours, ref):
        diff = (a - b).abs().max().item()
        print(f"deepseek2 GGUF Q8_0 experts, blocks vs dequantized: max|diff|={diff:.2e}")
        assert diff < 1e-3
    assert out == ref_out


_DENSE_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for llama-arch files (rotary halves paired up)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _add(w, name: str, a: np.ndarray, q8: bool) -> None:
    """A tensor as F32, or as Q8_0 where `q8` and it is a matrix of whole 32-value blocks."""
    import gguf

    if q8 and a.ndim >= 2 and a.shape[-1] % 32 == 0:
        q8_0 = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, gguf.quants.quantize(a, q8_0), raw_dtype=q8_0)
    else:
        w.add_tensor(name, np.ascontiguousarray(a))


def write_moe_gguf(model, arch: str, path: Path, q8: bool = False) -> None:
    """Qwen3-MoE (`qwen3moe`) or Mixtral (`llama` with experts) as llama.cpp writes them."""
    import gguf

    cfg = model.config
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_local_experts if arch == "llama" else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":  # Mixtral's experts are feed_forward_length wide, no key of their own
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    w.add_tensor("output.weight", state["lm_head.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for ours, theirs in _DENSE_NAMES.items():
            if pre + ours not in state:
                continue
            a = state[pre + ours].numpy()
            if arch == "llama" and ours in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = cfg.num_attention_heads if "q_proj" in ours else cfg.num_key_value_heads
                a = _permute(a, heads)
            _add(w, f"blk.{i}.{theirs}", a, q8)
        gate, up = state[pre + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
        experts = {
            "gate_proj": gate,
            "up_proj": up,
            "down_proj": state[pre + "mlp.experts.down_proj"],
        }
        for proj, theirs in _EXPERT.items():
            _add(w, f"blk.{i}.{theirs}.weight", experts[proj].contiguous().numpy(), q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family,arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_qwen3moe_and_mixtral_gguf_match_transformers(tmp_path, family, arch):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tiny_config(family)
    if family == "qwen3_moe":
        cfg.mlp_only_layers = []  # a GGUF has no dense-layer list: llama.cpp runs all sparse
    cfg.sliding_window = None  # released Mixtral GGUFs state none
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.2) if "norm" in name else p.normal_(0, 0.15)
        refs = [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    path = tmp_path / f"tiny-{arch}.gguf"
    write_moe_gguf(model, arch, path)
    loaded = load_model(path, torch.float32, weight_cache=False)
    assert (
        loaded.arch.family == family
        and loaded.arch.moe_layers == (0, 1, 2)[: cfg.num_hidden_layers]
    )
    logits, _ = paged_prefill_and_greedy(loaded.model, loaded.arch, PROMPTS, max_new=1, chunk=4)
    for ours, ref in zip(logits, refs):
        diff = (ours - ref).abs().max().item()
        print(f"{arch} GGUF: max|diff|={diff:.2e}")
        assert diff < 1e-4


def test_qwen3moe_q8_blocks_match_the_dequantized_file(tmp_path):
    """A Q8_0 qwen3moe served from its blocks (experts and attention as GGUFLinear; the C
    decoder stack stays off for MoE layers, the per-layer modules run) gives the logits and 8
    greedy tokens of the same file dequantized to float."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tiny_config("qwen3_moe")
    cfg.mlp_only_layers = []
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path / "tiny-qwen3moe-q8.gguf"
    write_moe_gguf(model, "qwen3moe", path, q8=True)
    blocks = load_model(path, torch.float32, gguf_blocks=True)
    dense = load_model(path, torch.float32, weight_cache=False)
    layer = blocks.model.model.layers[0]
    assert isinstance(layer.mlp.experts[0].gate_up_proj, GGUFLinear)
    assert isinstance(layer.self_attn.qkv_proj, GGUFLinear)
    ours, out = paged_prefill_and_greedy(blocks.model, blocks.arch, PROMPTS, max_new=8)
    ref, ref_out = paged_prefill_and_greedy(dense.model, dense.arch, PROMPTS, max_new=8)
    assert blocks.model.model.native.steps == 0
    for a, b in zip(ours, ref):
        diff = (a - b).abs().max().item()
        print(f"qwen3moe Q8_0 blocks vs dequantized: max|diff|={diff:.2e}")
        assert diff < 1e-3
    assert out == ref_out


@pytest.fixture(scope="module")
def v2_lite_twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three layers of the DeepSeek-V2-Lite layout twin at test size (Q4_K_M: Q4_K gate/up,
    Q5_0 and Q8_0 down experts, Q4_K/Q6_K shared experts, a dense first layer)."""
    from tidal.bench.synth import TwinSpec, synthesize

    spec = TwinSpec("deepseek-v2-lite", "q4_k_m", num_layers=3, tiny=True, tokenizer="bytes")
    return synthesize(spec, tmp_path_factory.mktemp("twin") / "v2-lite.gguf", quiet=True)


def test_the_experts_one_grouped_call_equals_one_call_each(v2_lite_twin: Path) -> None:
    """With int8 activations a step's experts with few tokens share one gate/up and one down
    kernel call (gguf_gemm_jobs), the busy ones take calls of their own: the layer's output is
    bit-identical to looping over the experts, for a decode-sized step and a prefill-sized one,
    and a request's greedy tokens are the same alone or batched."""
    from tidal import LLM, SamplingParams
    from tidal.layers import moe as moe_module
    from tidal.layers.moe import SparseMoE

    llm = LLM(str(v2_lite_twin), kv_cache_bytes=8 << 20, block_size=8, quantization="gguf-q8")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(layers) == 2 and layers[0]._expert_blocks() is not None
    torch.manual_seed(0)
    mixed = False  # a step with experts on both sides of JOBS_MAX_ROWS
    for tokens in (1, 3, 14, 40):
        x = torch.randn(tokens, layers[0].gate.weight.shape[1])
        grouped = layers[0](x)
        busy = layers[0].last_expert_tokens
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(SparseMoE, "_blocks_forward", lambda self, *args: None)
            looped = layers[0](x)
        assert torch.equal(grouped, looped), tokens
        limit = moe_module.JOBS_MAX_ROWS
        mixed |= bool((busy >= limit).any() and ((busy > 0) & (busy < limit)).any())
    assert mixed
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 33, 2, 71], [1, 2, 3], [100, 200, 300, 400, 17, 18, 19, 20, 21]]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == alone


def test_the_absorbed_decode_multiplies_by_the_files_latent_blocks(v2_lite_twin: Path) -> None:
    """A split deepseek2 file's attn_k_b / attn_v_b blocks reach each MLA layer cut per head
    (W_UK[h]^T and W_UV[h]); with int8 activations the decode rows multiply by them in one call
    for every head, within the activations' rounding of the float W_UK / W_UV products."""
    from tidal import LLM
    from tidal.attention.mla_paged import _per_head
    from tidal.layers.mla_attention import MLAttention

    llm = LLM(str(v2_lite_twin), kv_cache_bytes=8 << 20, block_size=8, quantization="gguf-q8")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MLAttention)]
    assert len(layers) == 3 and all(m._latent_jobs() is not None for m in layers)
    m = layers[1]
    assert len(m.uk_jobs) == m.num_heads and m.uk_jobs[0].rows == m.rank
    torch.manual_seed(1)
    q_nope, o_lat = torch.randn(3, m.num_heads, m.nope), torch.randn(3, m.num_heads, m.rank)
    for x, jobs, exact in (
        (q_nope, m.uk_jobs, torch.einsum("bhn,hnr->bhr", q_nope, m.w_uk)),
        (o_lat, m.uv_jobs, torch.einsum("bhr,hvr->bhv", o_lat, m.w_uv)),
    ):
        got = _per_head(x, jobs)
        assert got is not None and got.shape == exact.shape
        assert float((got - exact).norm() / exact.norm()) < 2e-2
    float_llm = LLM(str(v2_lite_twin), kv_cache_bytes=8 << 20, block_size=8, quantization="gguf")
    floats = [m for m in float_llm.engine.runner.model.modules() if isinstance(m, MLAttention)]
    assert all(m._latent_jobs() is None for m in floats)  # float activations: exact W_UK / W_UV
