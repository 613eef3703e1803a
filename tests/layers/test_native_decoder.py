"""The native decoder stack (one C call per step) against the per-layer modules it replaces:
the same bits for hidden states and KV pages, step after step, on every kernel path the machine
runs; and the shared gated activation against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.loader.test_weight_cache import write_tiny_quantized_gemma
from tests.models.paged import PagedBatch
from tests.models.test_gguf_models import _hf_model, write_gguf
from tidal.attention.kv_quant import QuantizedKV
from tidal.kernels import decoder, gguf_gemm, paged_attention
from tidal.kv.layout import KVLayout
from tidal.loader.model_loader import load_model
from tidal.quant.gguf_blocks import set_activations
from tidal.worker.kv_cache import allocate_kv_caches

pytestmark = pytest.mark.skipif(not decoder.available(), reason="no C compiler")

# the gemm's paths; attention and the elementwise kernels run their best at or below each
ISAS = ["scalar", *(isa for isa in ("avx2", "avx512") if isa in gguf_gemm.isas())]


@pytest.fixture
def isa(request, monkeypatch):
    """Every kernel's default path set to request.param (TIDAL_KERNEL_ISA, caches cleared)."""
    monkeypatch.setenv("TIDAL_KERNEL_ISA", request.param)
    cached = (decoder.default_isa, gguf_gemm.default_isa, paged_attention.default_isa)
    for fn in cached:
        fn.cache_clear()
    yield request.param
    monkeypatch.delenv("TIDAL_KERNEL_ISA")
    for fn in cached:
        fn.cache_clear()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Tiny GGUF models loaded as blocks: a Gemma 3 with mixed block types (Q8_0, Q5_0, Q4_K,
    Q6_K; one KV head, q/k norms, four norms per layer, GeGLU, a sliding layer) and a Llama
    with Q8_0 matrices (two KV heads, SwiGLU, no post-norms)."""
    d = tmp_path_factory.mktemp("native")
    gemma = d / "gemma.gguf"
    write_tiny_quantized_gemma(gemma)
    llama = d / "llama.gguf"
    write_gguf(_hf_model("llama"), "llama", "llama", llama, matrix_type="Q8_0")
    return {
        "gemma3": load_model(gemma, torch.float32, gguf_blocks=True),
        "llama": load_model(llama, torch.float32, gguf_blocks=True),
    }


def _caches(batch: PagedBatch, kv_dtype: str) -> list:
    """KV pages in kv_dtype laid out like batch's (same block ids)."""
    arch = batch.arch
    layout = KVLayout.from_layer_windows(
        arch.layer_windows(),
        block_size=batch.block_size,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype_bytes=4,
        kv_dtype=kv_dtype if kv_dtype in ("int8", "fp8") else "auto",
    )
    num_blocks = batch.kv[0][0].shape[0]
    float_dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
    return allocate_kv_caches(layout, num_blocks, float_dtype, "cpu")


def _pages(kv: list) -> list[torch.Tensor]:
    out = []
    for k, v in kv:
        for t in (k, v):
            out += [t.data, t.scale] if isinstance(t, QuantizedKV) else [t]
    return out


# A schedule of steps over three sequences: (chunks, starts, seq ids). Prefill chunks, a mixed
# prefill + decode step, decode steps; some steps exceed the sliding window (8 for Gemma).
_PROMPTS = [[5, 17, 33, 2, 9, 11, 40, 3, 8, 1], [9, 2, 40], [7, 7, 30, 21, 4, 6]]


def _schedule() -> list[tuple[list[list[int]], list[int], list[int]]]:
    p0, p1, p2 = _PROMPTS
    steps = [
        ([p0[:6], p1], [0, 0], [0, 1]),
        ([p0[6:], [12], p2[:4]], [6, 3, 0], [0, 1, 2]),
        ([[13], [14], p2[4:]], [10, 4, 4], [0, 1, 2]),
    ]
    for i in range(6):
        steps.append(([[20 + i], [30 + i], [40 + i]], [11 + i, 5 + i, 6 + i], [0, 1, 2]))
    return steps


def _run(model, arch, kv_dtype: str, native: bool):
    batch = PagedBatch(model, arch, max_len=32, num_seqs=3)
    batch.kv = _caches(batch, kv_dtype)
    model.model.native.enabled = native
    before = model.model.native.steps
    outs = []
    try:
        for chunks, starts, seqs in _schedule():
            outs.append(batch.step(chunks, starts, seqs))
    finally:
        model.model.native.enabled = True
    ran = model.model.native.steps - before
    return outs, _pages(batch.kv), ran


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_stack_matches_the_per_layer_path_bit_for_bit(tiny_models, family, act, kv_dtype, isa):
    loaded = tiny_models[family]
    model = loaded.model
    set_activations(model, act)
    model.model.native.reset()  # rebuilt with this test's ISA
    try:
        ref, ref_pages, ran_ref = _run(model, loaded.arch, kv_dtype, native=False)
        ours, pages, ran = _run(model, loaded.arch, kv_dtype, native=True)
        fused_norm = model.model.native._final_scale is not None
    finally:
        set_activations(model, "f32")
        model.model.native.reset()
    assert ran_ref == 0
    assert ran == len(_schedule())  # every step took the C stack
    assert fused_norm  # and the final norm ran in the same C call, with the same bits
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item():.3e}"
    for a, b in zip(pages, ref_pages):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("act", ["f32", "q8"])
def test_iq4_matrices_take_the_stack_bit_for_bit(tmp_path, act, isa):
    """IQ4_XS and IQ4_NL blocks go through the C stack's gemm like the other block types."""
    from tests.quant.test_gguf_blocks import IQ4_TYPES

    path = tmp_path / "iq4.gguf"
    write_tiny_quantized_gemma(path, types=IQ4_TYPES)
    loaded = load_model(path, torch.float32, gguf_blocks=True)
    model = loaded.model
    set_activations(model, act)
    ref, ref_pages, ran_ref = _run(model, loaded.arch, "float32", native=False)
    ours, pages, ran = _run(model, loaded.arch, "float32", native=True)
    assert ran_ref == 0 and ran == len(_schedule())
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item():.3e}"
    for a, b in zip(pages, ref_pages):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_chunk_longer_than_the_mlp_row_block_is_bit_for_bit(tiny_models, isa):
    """The stack's MLP takes a step's rows 128 at a time (decoder.c MLP_ROWS): a 600-token
    chunk, then a mixed step, give the per-layer path's outputs and pages bit for bit."""
    loaded = tiny_models["gemma3"]
    model = loaded.model
    set_activations(model, "q8")
    model.model.native.reset()
    prompt = [(13 * i) % 60 + 1 for i in range(600)]
    steps = [([prompt[:590], [3, 4]], [0, 0], [0, 1]), ([prompt[590:], [5]], [590, 2], [0, 1])]

    def run(native: bool):
        batch = PagedBatch(model, loaded.arch, max_len=640, num_seqs=2)
        model.model.native.enabled = native
        before = model.model.native.steps
        try:
            outs = [batch.step(*step) for step in steps]
        finally:
            model.model.native.enabled = True
        return outs, _pages(batch.kv), model.model.native.steps - before

    try:
        ref, ref_pages, ran_ref = run(False)
        ours, pages, ran = run(True)
    finally:
        set_activations(model, "f32")
        model.model.native.reset()
    assert ran_ref == 0 and ran == len(steps)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    for a, b in zip(pages, ref_pages):
        assert torch.equal(a, b)


def test_large_f32_prefill_takes_the_per_layer_path(tiny_models):
    """Above F32_KERNEL_MAX_ROWS tokens, "f32" mode multiplies decoded tiles with torch; the
    stack steps aside and the result is still the model's."""
    loaded = tiny_models["llama"]
    model = loaded.model
    batch = PagedBatch(model, loaded.arch, max_len=64, num_seqs=1)
    before = model.model.native.steps
    prompt = [(7 * i) % 100 + 1 for i in range(40)]
    batch.step([prompt], [0], [0])
    assert model.model.native.steps == before
    batch.step([[3]], [40], [0])
    assert model.model.native.steps == before + 1


def test_float_weights_never_take_the_stack(tiny_models, tmp_path):
    path = tmp_path / "llama-f16.gguf"
    write_gguf(_hf_model("llama"), "llama", "llama", path)
    loaded = load_model(path, torch.float32, weight_cache=False)
    batch = PagedBatch(loaded.model, loaded.arch, max_len=16, num_seqs=1)
    batch.step([[1, 2, 3]], [0], [0])
    assert loaded.model.model.native.steps == 0
    assert loaded.model.model.native.stack is None


def test_timings_split_the_step(tiny_models):
    loaded = tiny_models["gemma3"]
    model = loaded.model
    batch = PagedBatch(model, loaded.arch, max_len=16, num_seqs=1)
    batch.step([[1, 2, 3]], [0], [0])
    stack = model.model.native.stack
    assert stack is not None
    stack.times = [0.0] * len(decoder.TIME_SLOTS)
    try:
        batch.step([[4]], [3], [0])
        assert all(t > 0 for t in stack.times), stack.times
    finally:
        stack.times = None


@pytest.mark.parametrize("act,ref", [
    ("silu", F.silu),
    ("gelu_pytorch_tanh", lambda x: F.gelu(x, approximate="tanh")),
])  # fmt: skip
def test_gated_act_matches_torch_and_is_the_same_on_every_path(act, ref):
    torch.manual_seed(0)
    inter = 77  # a vector body and a scalar tail
    gu = torch.randn(5, 2 * inter) * 4
    gu[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-8, -1e-8])
    expect = ref(gu[:, :inter].double()) * gu[:, inter:].double()
    lib = decoder._library()
    outs = []
    for isa in range(lib.tidal_decoder_best_isa() + 1):
        out = torch.empty(5, inter)
        lib.tidal_gated_act(gu.data_ptr(), 5, inter, 2 * inter, decoder.ACT_CODES[act],
                            out.data_ptr(), inter, isa)  # fmt: skip
        outs.append(out)
        torch.testing.assert_close(out.double(), expect, rtol=2e-6, atol=1e-6)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    # one row alone gives the bits it gives in the batch
    alone = decoder.gated_act(gu[3:4].clone(), inter, act)
    assert torch.equal(alone[0], decoder.gated_act(gu, inter, act)[3])


def test_gated_act_declines_what_it_cannot_take():
    assert decoder.gated_act(torch.randn(2, 8, dtype=torch.float64), 4, "silu") is None
    assert decoder.gated_act(torch.randn(2, 8), 4, "relu") is None
    assert decoder.gated_act(torch.randn(2, 10), 4, "silu") is None
