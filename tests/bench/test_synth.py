"""Layout twins (`tidal bench synth`): synthetic blocks decode to zero-mean values of the intended
spread, the table reproduces llama-quantize's types, and a small twin of every architecture
parses back exactly, loads in tidal.LLM (and llama.cpp, where built) and generates."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tidal.bench.cli import main as bench_main
from tidal.bench.synth import TwinSpec, parse_name, plan_twin, synthesize
from tidal.bench.twin_donor import DONOR_FILE_BYTES, DONOR_NAME, DonorUnavailable
from tidal.bench.twin_header import (
    ARRAY,
    INT32,
    STRING,
    UINT32,
    Header,
    TensorSpec,
    encode_header,
    meta,
    parse_header,
)
from tidal.bench.twin_layouts import (
    ARCHITECTURES,
    RECIPES,
    keep_layers,
    table_tensors,
    use_more_bits,
)
from tidal.bench.twin_tokenizer import donor_tokenizer
from tidal.bench.twin_weights import MATRIX_STD, SYNTH_TYPES, RandomBytes, k_scales, tensor_chunks
from tidal.loader.cache_files import byte_alphabet, tidal_cache_dir
from tidal.loader.gguf_file import GGUFFile
from tidal.quant.gguf_dequant import dequantize
from tidal.quant.gguf_types import GGMLType

Q4_K, Q6_K, F32 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F32
Q5_0, Q8_0 = GGMLType.Q5_0, GGMLType.Q8_0
DENSE = [name for name, a in ARCHITECTURES.items() if a.experts is None]
# one recipe per dense architecture, so the five small twins cover all four recipes; DeepSeek
# V2-Lite (MLA and experts) in Q4_K_M
SMALL_TWINS = [*zip(DENSE, ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_k_m"]),
               ("deepseek-v2-lite", "q4_k_m")]  # fmt: skip


def _data(spec: TensorSpec, values: list[float] | None = None) -> np.ndarray:
    source = RandomBytes(seed=1, chunk_bytes=1 << 15)  # small chunks: several per tensor
    return np.concatenate([c.copy() for c in tensor_chunks(spec, source, values)])


@pytest.mark.parametrize("type_name", SYNTH_TYPES)
def test_blocks_decode_to_zero_mean_values_of_the_intended_spread(type_name: str) -> None:
    gguf = pytest.importorskip("gguf")
    ggml_type = GGMLType[type_name]
    spec = TensorSpec("blk.0.ffn_up.weight", (64, 2048), ggml_type)
    raw = _data(spec)
    assert raw.size == spec.nbytes
    ours = dequantize(torch.from_numpy(raw), ggml_type, spec.shape)
    ref = gguf.quants.dequantize(raw.reshape(64, -1), gguf.GGMLQuantizationType(int(ggml_type)))
    assert torch.isfinite(ours).all()
    assert np.array_equal(ref, ours.numpy())  # gguf-py reads the same values
    # 131,072 values: the mean's standard error is 5.5e-5
    assert abs(float(ours.mean())) < 5e-4
    assert float(ours.std()) == pytest.approx(MATRIX_STD, rel=0.03)
    assert float(ours.mean(dim=1).abs().max()) < 0.004  # every row zero-mean, not just the sum


def test_k_scales_pack_every_six_bit_scale_and_min() -> None:
    rng = np.random.default_rng(0)
    one, zero = np.float16(1.0).tobytes(), b"\x11" * 128  # d = dmin = 1, every code 1
    for _ in range(16):
        sc, mins = rng.integers(0, 64, 8).tolist(), rng.integers(0, 64, 8).tolist()
        block = np.frombuffer(one + one + k_scales(sc, mins) + zero, np.uint8).copy()
        values = dequantize(torch.from_numpy(block), Q4_K, (256,)).reshape(8, 32)
        expected = torch.tensor([s - m for s, m in zip(sc, mins)], dtype=torch.float32)
        assert torch.equal(values[:, 0], expected) and (values == values[:, :1]).all()


def test_vectors_are_ones_zeros_or_the_values_given() -> None:
    norm = _data(TensorSpec("blk.3.attn_norm.weight", (96,), F32)).view(np.float32)
    bias = _data(TensorSpec("blk.3.attn_q.bias", (96,), F32)).view(np.float32)
    freqs = _data(TensorSpec("rope_freqs.weight", (3,), F32), [1.0, 2.5, 8.0]).view(np.float32)
    assert (norm == 1).all() and (bias == 0).all() and freqs.tolist() == [1.0, 2.5, 8.0]


def test_use_more_bits_is_llama_cpps_pattern_for_28_layers() -> None:
    # Qwen2.5-7B / DeepSeek-R1-Distill-Qwen-7B Q4_K_M: attn_v and ffn_down are Q6_K on these
    assert [i for i in range(28) if use_more_bits(i, 28)] == [
        0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch_name", DENSE)
def test_the_table_gives_llama_quantizes_types(arch_name: str, recipe: str) -> None:
    arch, r = ARCHITECTURES[arch_name], RECIPES[recipe]
    tensors = table_tensors(arch, r)
    per_layer = 9 + 3 * arch.qkv_bias + 2 * arch.qk_norm
    globals_ = 3 + (arch.llama3_rope is not None)
    assert len(tensors) == globals_ + per_layer * arch.num_layers
    types = {t.name: t.ggml_type for t in tensors}
    assert types["output.weight"] == (GGMLType.Q8_0 if recipe == "q8_0" else Q6_K)
    assert types["token_embd.weight"] == r.default_type
    assert tensors[0].name == "output.weight" and tensors[-1].name.startswith(
        f"blk.{arch.num_layers - 1}."
    )
    for t in tensors:
        if len(t.shape) == 1:
            assert t.ggml_type == F32, t.name
        elif t.name.endswith(("attn_v.weight", "ffn_down.weight")) and r.more_bits:
            layer = int(t.name.split(".")[1])
            more = use_more_bits(layer, arch.num_layers)
            assert t.ggml_type == (Q6_K if more else r.default_type), t.name
        elif t.name.startswith("blk."):
            assert t.ggml_type == r.default_type, t.name


def test_deepseek_v2_lite_q4_k_m_has_llama_quantizes_types_and_the_files_size() -> None:
    """llama-quantize's Q4_K_M on DeepSeek-V2-Lite in llama.cpp's split MLA form: every
    ffn_down (dense, routed and shared experts) Q6_K on use_more_bits layers; rows that are not
    whole super-blocks fall back (the experts' 1408 and the dense layer's 10944 inputs: Q4_K ->
    Q5_0, Q6_K -> Q8_0; attn_k_b's 128: Q5_0); the router F32."""
    arch = ARCHITECTURES["deepseek-v2-lite"]
    tensors = table_tensors(arch, RECIPES["q4_k_m"])
    types: dict[tuple[str, GGMLType], int] = {}
    for t in tensors:
        short = t.name.split(".", 2)[2] if t.name.startswith("blk.") else t.name
        types[short, t.ggml_type] = types.get((short, t.ggml_type), 0) + 1
    more = [i for i in range(27) if use_more_bits(i, 27)]
    assert len(more) == 13 and 0 in more  # the dense layer and 12 sparse ones
    assert types == {
        ("token_embd.weight", Q4_K): 1, ("output.weight", Q6_K): 1, ("output_norm.weight", F32): 1,
        ("attn_norm.weight", F32): 27, ("ffn_norm.weight", F32): 27,
        ("attn_q.weight", Q4_K): 27, ("attn_kv_a_mqa.weight", Q4_K): 27,
        ("attn_kv_a_norm.weight", F32): 27, ("attn_k_b.weight", Q5_0): 27,
        ("attn_v_b.weight", Q4_K): 27, ("attn_output.weight", Q4_K): 27,
        ("ffn_gate.weight", Q4_K): 1, ("ffn_up.weight", Q4_K): 1, ("ffn_down.weight", Q8_0): 1,
        ("ffn_gate_inp.weight", F32): 26, ("ffn_gate_exps.weight", Q4_K): 26,
        ("ffn_up_exps.weight", Q4_K): 26, ("ffn_down_exps.weight", Q8_0): 12,
        ("ffn_down_exps.weight", Q5_0): 14, ("ffn_gate_shexp.weight", Q4_K): 26,
        ("ffn_up_shexp.weight", Q4_K): 26, ("ffn_down_shexp.weight", Q6_K): 12,
        ("ffn_down_shexp.weight", Q4_K): 14,
    }  # fmt: skip
    shapes = {t.name: t.shape for t in tensors}
    assert shapes["blk.1.ffn_gate_exps.weight"] == (64, 1408, 2048)
    assert shapes["blk.1.attn_k_b.weight"] == (16, 512, 128)
    assert shapes["blk.1.attn_v_b.weight"] == (16, 128, 512)
    assert shapes["blk.1.attn_q.weight"] == (16 * 192, 2048)
    assert shapes["blk.1.attn_kv_a_mqa.weight"] == (576, 2048)
    assert sum(t.nbytes for t in tensors) == 10_363_959_296  # 9.65 GiB


def test_names_parse_and_unknown_ones_are_refused() -> None:
    assert parse_name("qwen2.5-7b-q4_k_m") == ("qwen2.5-7b", "q4_k_m")
    assert parse_name("mistral-7b-v0.3-q8_0") == ("mistral-7b-v0.3", "q8_0")
    assert parse_name(DONOR_NAME) == (DONOR_NAME, None)
    with pytest.raises(ValueError, match="unknown"):
        parse_name("llama-3.1-8b-q3_k_s")
    with pytest.raises(ValueError, match="num_layers"):
        plan_twin(TwinSpec("qwen3-8b", "q8_0", num_layers=37, tiny=True, tokenizer="bytes"))
    with pytest.raises(ValueError, match="real header"):
        plan_twin(TwinSpec(DONOR_NAME, "q8_0"))


def _small_spec(arch: str, recipe: str) -> TwinSpec:
    # DeepSeek V2-Lite keeps its 27 layers: llama.cpp knows the model (no q_lora) by that count
    layers = None if ARCHITECTURES[arch].mla else 2
    return TwinSpec(arch, recipe, num_layers=layers, tiny=True, tokenizer="bytes")


@pytest.fixture(scope="module")
def small_twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("twins")
    return {
        arch: synthesize(_small_spec(arch, recipe), folder / f"{arch}.gguf", quiet=True)
        for arch, recipe in SMALL_TWINS
    }


@pytest.mark.parametrize(("arch", "recipe"), SMALL_TWINS)
def test_a_small_twin_parses_back_with_the_recipes_layout(
    small_twins: dict[str, Path], arch: str, recipe: str
) -> None:
    tiny = ARCHITECTURES[arch].tiny()
    layers = _small_spec(arch, recipe).num_layers or tiny.num_layers
    expected = keep_layers(table_tensors(tiny, RECIPES[recipe]), layers)
    with GGUFFile(small_twins[arch]) as f:
        got = [TensorSpec(t.name, t.shape, t.ggml_type) for t in f.tensors.values()]
        assert got == expected
        assert f.metadata[f"{tiny.gguf_arch}.block_count"] == layers
        assert f.metadata["general.file_type"] == RECIPES[recipe].file_type
        assert len(f.metadata["tokenizer.ggml.tokens"]) == tiny.vocab_size
        embd = f.load_tensor("token_embd.weight")
        assert torch.isfinite(embd).all() and float(embd.std()) == pytest.approx(0.02, rel=0.1)


def test_tidal_reads_the_deepseek_twins_latent_experts_and_yarn(
    small_twins: dict[str, Path],
) -> None:
    from tidal.config.arch import FULL, arch_from_gguf

    with GGUFFile(small_twins["deepseek-v2-lite"]) as f:
        arch = arch_from_gguf(f.metadata, "output.weight" in f.tensors)
    assert arch.family == "deepseek_v2" and arch.num_layers == 27
    assert arch.mla is not None and arch.moe is not None
    assert (arch.mla.q_lora_rank, arch.mla.kv_lora_rank, arch.mla.qk_nope_head_dim,
            arch.mla.qk_rope_head_dim, arch.mla.v_head_dim) == (None, 512, 32, 64, 32)  # fmt: skip
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size,
            moe.scoring, moe.norm_topk_prob) == (16, 2, 128, 256, "softmax", False)  # fmt: skip
    assert arch.moe_layers == tuple(range(1, 27))
    scaling = arch.rope[FULL].scaling_dict()
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 40.0
    assert scaling["original_max_position_embeddings"] == 4096
    assert scaling["mscale_all_dim"] == pytest.approx(0.707, rel=1e-6)


@pytest.mark.parametrize(("arch", "recipe"), SMALL_TWINS)
def test_a_small_twin_generates_in_tidal(
    small_twins: dict[str, Path], arch: str, recipe: str
) -> None:
    from tidal import LLM, SamplingParams

    llm = LLM(str(small_twins[arch]), kv_cache_bytes=4 << 20, block_size=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    out = llm.generate(["Hello there, the"], params)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(math.isfinite(lp.logprob) for step in out.logprobs for lp in step.values())


@pytest.mark.parametrize(("arch", "recipe"), SMALL_TWINS)
def test_a_small_twin_is_served_by_tidal_serve(
    small_twins: dict[str, Path], arch: str, recipe: str
) -> None:
    """A real `tidal serve` process on 127.0.0.1 loads the twin and answers a chat completion
    through the openai SDK (the twin's chat template, its tokenizer, greedy, 4 tokens)."""
    import openai

    from tests.server.tiny_server import serve

    for server in serve(["--model", str(small_twins[arch]), "--kv-cache-bytes", str(4 << 20),
                         "--threads", "1", "--no-warmup"]):  # fmt: skip
        client = openai.OpenAI(api_key="none", base_url=server.base_url + "/v1", max_retries=0,
                               timeout=60)  # fmt: skip
        models = [m.id for m in client.models.list().data]
        out = client.chat.completions.create(
            model=models[0], messages=[{"role": "user", "content": "Hello there"}], max_tokens=4,
            temperature=0, logprobs=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        choice = out.choices[0]
        assert out.usage is not None and out.usage.completion_tokens == 4
        assert choice.finish_reason == "length" and choice.logprobs is not None
        assert all(math.isfinite(t.logprob) for t in choice.logprobs.content)


def test_a_twin_is_kept_when_its_record_matches(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    spec = TwinSpec("qwen3-8b", "q8_0", num_layers=1, tiny=True, tokenizer="bytes")
    synthesize(spec, path, quiet=True)
    mtime = path.stat().st_mtime_ns
    time.sleep(0.01)  # NOTE: mtime granularity; the check is whether the file was rewritten
    assert synthesize(spec, path, quiet=True) == path and path.stat().st_mtime_ns == mtime
    synthesize(spec, path, force=True, quiet=True)
    assert path.stat().st_mtime_ns != mtime
    other = TwinSpec("qwen3-8b", "q6_k", num_layers=1, tiny=True, tokenizer="bytes")
    synthesize(other, path, quiet=True)  # another recipe under the same name: rewritten
    with GGUFFile(path) as f:
        assert f.metadata["general.file_type"] == RECIPES["q6_k"].file_type


def test_the_command_writes_to_the_cache_and_prints_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    argv = ["synth", "mistral-7b-v0.3-q4_k_m", "--tiny", "--layers", "1", "--tokenizer", "bytes"]
    assert bench_main(argv) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == tmp_path / "twins" / "mistral-7b-v0.3-tiny-q4_k_m-l1-bytetok.gguf"
    assert path.is_file() and path.with_name(path.name + ".twin.json").is_file()
    assert bench_main(["synth", "--list"]) == 0
    assert "qwen3-8b-RECIPE" in capsys.readouterr().out
    assert bench_main(["synth", "qwen3-8b"]) == 2  # no recipe


def _fake_donor() -> Header:
    """A donor shaped like the DeepSeek header: bytes, merges, specials, then padding."""
    table = byte_alphabet()
    tokens = [table[b] for b in range(256)]
    merges = ['! "', '!" #', "$ %", "# $"]  # the last one's result is never a token
    tokens += ['!"', '!"#', "$%"] + [f"w{i}" for i in range(400)]
    specials = ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜begin▁of▁sentence｜>", "<think>"]
    types = [1] * len(tokens) + [3, 3, 3, 4] + [5] * 6
    eos, bos = len(tokens), len(tokens) + 2
    tokens += specials + [f"[PAD{len(tokens) + 4 + i}]" for i in range(6)]
    metadata = (
        meta("general.architecture", "qwen2", STRING),
        meta("tokenizer.ggml.model", "gpt2", STRING),
        meta("tokenizer.ggml.pre", "deepseek-r1-qwen", STRING),
        meta("tokenizer.ggml.tokens", tokens, ARRAY, STRING),
        meta("tokenizer.ggml.token_type", types, ARRAY, INT32),
        meta("tokenizer.ggml.merges", merges, ARRAY, STRING),
        meta("tokenizer.ggml.bos_token_id", bos, UINT32),
        meta("tokenizer.ggml.eos_token_id", eos, UINT32),
    )
    header, _ = parse_header(encode_header(metadata, ())[0])  # and the round trip
    assert header.metadata == metadata
    return header


def test_the_donor_tokenizer_is_cut_with_its_specials_kept(tmp_path: Path) -> None:
    from tidal.loader.tokenizer import load_tokenizer

    donor = _fake_donor()
    keys = {m.key: m for m in donor_tokenizer(donor, 600)}
    tokens = keys["tokenizer.ggml.tokens"].value()
    assert len(tokens) == 600 and tokens[-4:] == [
        "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜begin▁of▁sentence｜>", "<think>"]  # fmt: skip
    assert keys["tokenizer.ggml.token_type"].value()[-5:] == [1, 3, 3, 3, 4]
    assert keys["tokenizer.ggml.eos_token_id"].value() == 596
    assert keys["tokenizer.ggml.bos_token_id"].value() == 598
    assert keys["tokenizer.ggml.merges"].value() == ['! "', '!" #', "$ %"]
    padded = {m.key: m.value() for m in donor_tokenizer(donor, 700)}
    assert (
        len(padded["tokenizer.ggml.tokens"]) == 700
        and padded["tokenizer.ggml.tokens"][-1] == "[PAD699]"
    )
    assert padded["tokenizer.ggml.eos_token_id"] == 659  # unchanged
    with pytest.raises(ValueError, match="too small"):
        donor_tokenizer(donor, 300)
    path = tmp_path / "tok.gguf"
    path.write_bytes(encode_header([donor.metadata[0], *keys.values()], ())[0])
    tok = load_tokenizer(path)
    assert tok.encode('<think>!"#', add_special_tokens=False) == [599, 257]


def _llama_bench() -> str | None:
    path = tidal_cache_dir() / "llama.cpp" / "bin" / "llama-bench"
    return str(path) if path.exists() else shutil.which("llama-bench")


@pytest.mark.skipif(_llama_bench() is None, reason="llama.cpp's llama-bench is not built")
@pytest.mark.parametrize(("arch", "recipe"), SMALL_TWINS)
def test_llama_cpp_loads_a_small_twin(small_twins: dict[str, Path], arch: str, recipe: str) -> None:
    cmd = [str(_llama_bench()), "-m", str(small_twins[arch]), "-p", "0", "-n", "4", "-t", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tg4" in done.stdout


def _ik_llama_bench() -> str | None:
    path = tidal_cache_dir() / "ik_llama.cpp" / "bin" / "llama-bench"
    return str(path) if path.exists() else None


@pytest.mark.skipif(_ik_llama_bench() is None, reason="ik_llama.cpp's llama-bench is not built")
def test_ik_llama_cpp_loads_the_deepseek_twin(small_twins: dict[str, Path]) -> None:
    """ik_llama.cpp takes llama.cpp's MQA form of MLA only at DeepSeek's latent sizes (576 and
    512 values, 64 rotary): the tiny twin keeps them."""
    cmd = [str(_ik_llama_bench()), "-m", str(small_twins["deepseek-v2-lite"]), "-p", "0", "-n",
           "4", "-t", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tg4" in done.stdout


# ---------------------------------------------------------------- the real header (network)


def _donor_or_skip() -> Header:
    from tidal.bench.twin_donor import read_donor_header

    try:
        return read_donor_header()
    except DonorUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_the_header_twin_is_the_real_files_layout(tmp_path: Path) -> None:
    donor = _donor_or_skip()
    plan = plan_twin(TwinSpec(DONOR_NAME))
    assert plan.metadata == list(donor.metadata) and plan.tensors == list(donor.tensors)
    header, offsets = encode_header(plan.metadata, plan.tensors)
    assert len(header) + offsets[-1] + plan.tensors[-1].nbytes == DONOR_FILE_BYTES
    # the table reproduces the real file's every tensor: name, shape, type and order
    table = table_tensors(ARCHITECTURES["deepseek-r1-distill-qwen-7b"], RECIPES["q4_k_m"])
    assert table == list(donor.tensors)
    # two layers of it, with the real tokenizer and chat template
    path = synthesize(TwinSpec(DONOR_NAME, num_layers=2), tmp_path / "ds.gguf", quiet=True)
    with GGUFFile(path) as f:
        assert f.metadata["qwen2.block_count"] == 2
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 152064
    from tidal import LLM, SamplingParams

    llm = LLM(str(path), kv_cache_bytes=16 << 20)
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hi"}])
    out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama-3.1-8b", "qwen3-8b", "mistral-7b-v0.3"])
def test_a_table_twin_with_the_donor_tokenizer_generates(tmp_path: Path, arch: str) -> None:
    _donor_or_skip()
    spec = TwinSpec(arch, "q4_k_m", num_layers=1)
    path = synthesize(spec, tmp_path / "t.gguf", quiet=True)
    with GGUFFile(path) as f:
        assert len(f.metadata["tokenizer.ggml.tokens"]) == ARCHITECTURES[arch].vocab_size
    from tidal import LLM, SamplingParams

    llm = LLM(str(path), kv_cache_bytes=16 << 20)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 2


@pytest.mark.slow
def test_a_full_7b_twin_writes_in_minutes_and_generates() -> None:
    """Qwen2.5-7B Q4_K_M in tidal's cache (kept for later runs): 4.7 GB written streaming."""
    path = synthesize(TwinSpec("qwen2.5-7b", "q4_k_m", tokenizer="bytes"))
    assert path.stat().st_size == pytest.approx(4.68e9, rel=0.01)
    from tidal import LLM, SamplingParams

    llm = LLM(str(path), kv_cache_bytes=64 << 20, max_model_len=64)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 2


@pytest.mark.slow
def test_the_v2_lite_twin_is_served_with_the_r1_reasoning_parser() -> None:
    """DeepSeek-V2-Lite Q4_K_M's layout (10.4 GB, kept in tidal's cache) through a real `tidal
    serve` with `--reasoning-parser deepseek_r1` and the openai SDK: the chat answer is split
    into reasoning and content as an R1 model's would be (random weights: the text is noise)."""
    _donor_or_skip()
    import openai

    from tests.server.tiny_server import serve

    path = synthesize(TwinSpec("deepseek-v2-lite", "q4_k_m"))
    assert path.stat().st_size == pytest.approx(10.37e9, rel=0.01)
    for server in serve(["--model", str(path), "--kv-cache-bytes", str(64 << 20), "--threads", "2",
                         "--no-warmup", "--reasoning-parser", "deepseek_r1"]):  # fmt: skip
        client = openai.OpenAI(api_key="none", base_url=server.base_url + "/v1", max_retries=0,
                               timeout=600)  # fmt: skip
        model = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.usage is not None and out.usage.completion_tokens == 6
        message = out.choices[0].message
        # no </think> among noise: all of it is reasoning, as R1's parser reads an open block
        reasoning = getattr(message, "reasoning_content", None)
        assert (reasoning or "") + (message.content or "") != ""
