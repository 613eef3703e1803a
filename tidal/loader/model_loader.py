"""load_model: a checkpoint path (GGUF file or HF directory) -> a ready model, its ArchConfig and tokenizer."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tidal.config.arch import ArchConfig, arch_from_gguf, arch_from_hf
from tidal.layers.rotary import RotaryEmbedding, inv_frequencies
from tidal.loader.shard import ShardPlan, slice_blocks, slice_tensor
from tidal.models.registry import model_class

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    arch: ArchConfig
    path: Path
    dtype: torch.dtype
    device: torch.device
    load_time_s: float
    # This process's tensor-parallel share (arch then holds the rank's heads); None: the whole model.
    shard: ShardPlan | None = None


def read_arch(path: str | Path) -> tuple[ArchConfig, str | None]:
    """The ArchConfig of a checkpoint, and the GGUF architecture name for GGUF files."""
    arch, gguf_arch, _ = _read_header(Path(path))
    return arch, gguf_arch


def _read_header(p: Path) -> tuple[ArchConfig, str | None, torch.Tensor | None]:
    """ArchConfig, GGUF architecture name and llama.cpp rope frequency factors, from one open
    (parsing a GGUF's 262k-token vocabulary costs ~0.2 s each time)."""
    if p.is_dir():
        config = p / "config.json"
        if not config.exists():
            raise ValueError(
                f"{p} is a directory without config.json; expected a HF model directory"
            )
        return arch_from_hf(json.loads(config.read_text())), None, None
    try:
        st = p.stat()
    except OSError:
        raise ValueError(f"model path {str(p)!r} does not exist") from None
    return _read_gguf_header(str(p), st.st_size, st.st_mtime_ns, st.st_ino)


# NOTE: a per-process memo keyed by the file's identity: building an engine reads the header
# twice (the builder, then load_model), and a standby process reads it ahead of time, so a
# restart parses it zero times. Values are immutable (the rope tensor is only divided into).
@functools.lru_cache(maxsize=4)
def _read_gguf_header(
    path: str, size_bytes: int, mtime_ns: int, inode: int
) -> tuple[ArchConfig, str | None, torch.Tensor | None]:
    from tidal.loader.gguf_file import ARCH_STRINGS_DECODED, GGUFFile

    # The vocabulary's size is all arch_from_gguf reads of its strings: counted, not decoded.
    with GGUFFile(path, count_strings_over=ARCH_STRINGS_DECODED) as f:
        arch = arch_from_gguf(f.metadata, "output.weight" in f.tensors)
        freqs = f.load_tensor("rope_freqs.weight") if "rope_freqs.weight" in f.tensors else None
        return arch, f.architecture(), freqs


def kv_group_of_layers(arch: ArchConfig) -> list[int]:
    """KV group of each layer, as tidal.kv.layout.KVLayout groups them."""
    from tidal.kv.layout import KVLayout

    layout = KVLayout.from_layer_windows(
        arch.layer_windows(),
        block_size=16,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype_bytes=4,
    )
    return [layout.layer_slot(i)[0] for i in range(arch.num_layers)]


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Modules built on meta skip their random initialisation: the checkpoint replaces it anyway.

    NOTE: an init on a meta tensor costs nothing itself, but the first one (nn.Embedding's
    normal_) runs through a torch function wrapped to disable dynamo, whose first call imports
    torch._dynamo: 1-3 s of every start-up for nothing else. transformers' no_init_weights does
    the same swap."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
)  # fmt: skip


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def build_on_meta(arch: ArchConfig) -> nn.Module:
    """The model for `arch` on the meta device, without weight init (see _no_weight_init): no
    memory, and none of the imports (torch._dynamo, sympy: ~800 modules, ~65 MB) an init on
    meta would pull in. The engine's loader and the standby process build through this."""
    with torch.device("meta"), _no_weight_init():
        return model_class(arch)(arch, kv_group_of_layers(arch))


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    weight_cache: bool = True,
    gguf_blocks: bool = False,
    tensor_parallel: tuple[int, int] | None = None,
    huge_pages: bool = True,
) -> LoadedModel:
    """Build the model on the meta device and assign the checkpoint's tensors, so peak memory stays
    near one copy of the weights.

    With `gguf_blocks` a GGUF's quantized matrices stay in the file's blocks (memory-mapped) and
    run through tidal.quant.gguf_blocks; only the small float tensors (norms) are decoded. With
    `huge_pages` too, the largest of them are mapped so that tidal.loader.resident can move them
    into huge pages later (promote_resident; build_engine starts it).
    Otherwise, with `weight_cache`, a GGUF's tensors, once dequantized and renamed, are saved
    beside it (tidal.loader.weight_cache) and later loads memory-map that file instead of
    dequantizing; the tensors are bit-identical either way.

    `tensor_parallel=(rank, world_size)` loads only that rank's slices (tidal.loader.shard) and
    builds the layers at their shard's size; the caller wraps the model with
    tidal.layers.parallel.parallelize. It bypasses the weight cache (a cache of the whole model).
    """
    start = time.perf_counter()
    p = Path(path)
    device = torch.device(device)
    if gguf_blocks and (p.is_dir() or device.type != "cpu"):
        where = "a HF directory" if p.is_dir() else f"device {device.type}"
        raise ValueError(
            f"quantization='gguf' is invalid for {where}: GGUF blocks run on CPU from a GGUF "
            "file; expected quantization none, int8, int4 or fp8"
        )
    arch, gguf_arch, freq_factors = _read_header(p)
    shard = None if tensor_parallel is None else ShardPlan(arch, *tensor_parallel)
    local = arch if shard is None else shard.local_arch()
    model = build_on_meta(local)
    if shard is not None:
        with torch.device("meta"), _no_weight_init():
            _shard_vocabulary(model, shard)
    if gguf_blocks:
        assert gguf_arch is not None  # a file, checked above
        state = _load_gguf_blocks(model, p, arch, gguf_arch, dtype, shard, huge_pages)
        return _finish(
            model, local, p, dtype, device, state, freq_factors, start, "GGUF blocks", shard
        )
    expected = dict(model.state_dict(keep_vars=True))
    use_cache = weight_cache and not p.is_dir() and shard is None
    state: dict[str, torch.Tensor] | None = None
    if use_cache:
        from tidal.loader.weight_cache import load_weight_cache, weight_cache_key

        key = weight_cache_key(p, dtype)  # before reading: a GGUF replaced mid-load goes stale
        state = load_weight_cache(p, dtype, key)
        if state is not None and not _fits(state, expected, dtype):
            log.warning("weight cache of %s does not fit the model; loading the GGUF", p.name)
            state = None
    source = "weight cache" if state is not None else "checkpoint"
    if state is None:
        state = _read_state(p, arch, gguf_arch, expected, dtype, device, shard)
        if use_cache:
            from tidal.loader.weight_cache import save_weight_cache

            save_weight_cache(p, dtype, key, state)
    elif device.type != "cpu":
        state = {name: t.to(device) for name, t in state.items()}
    return _finish(model, local, p, dtype, device, state, freq_factors, start, source, shard)


def _shard_vocabulary(model: nn.Module, shard: ShardPlan) -> None:
    """Embedding and LM head (on meta) at this rank's vocabulary rows."""
    rows, hidden = shard.vocab_range[1] - shard.vocab_range[0], shard.arch.hidden_size
    model.model.embed_tokens = nn.Embedding(rows, hidden)
    model.lm_head = nn.Linear(hidden, rows, bias=False)
    if _tied(model):
        model.lm_head.weight = model.model.embed_tokens.weight


def _finish(
    model: nn.Module,
    arch: ArchConfig,
    p: Path,
    dtype: torch.dtype,
    device: torch.device,
    state: dict[str, torch.Tensor],
    freq_factors: torch.Tensor | None,
    start: float,
    source: str,
    shard: ShardPlan | None = None,
) -> LoadedModel:
    """Assign the float tensors, tie the head, build rotary tables, fuse projections."""
    weights_s = time.perf_counter() - start
    expected = dict(model.state_dict(keep_vars=True))
    missing = [
        n
        for n, t in expected.items()
        if t.is_meta and n not in state and not (n == "lm_head.weight" and _tied(model))
    ]
    if missing:
        raise ValueError(f"{p}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    if _tied(model) and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # non-persistent buffers are still on meta
        if isinstance(module, RotaryEmbedding):
            inv_freq = inv_frequencies(module.head_dim, module.rope)
            if freq_factors is not None:
                inv_freq = inv_freq / freq_factors  # llama.cpp's form of Llama 3.1 rope scaling
            module.inv_freq = inv_freq.to(device)
    model.eval().requires_grad_(False)
    for module in list(model.modules()):
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None:
            fuse()
    load_time_s = time.perf_counter() - start
    log.info(
        "model loaded from %s in %.2f s (weights from the %s in %.2f s)",
        p.name,
        load_time_s,
        source,
        weights_s,
    )
    return LoadedModel(model, arch, p, dtype, device, load_time_s, shard)


# names iter_gguf_weights gives a split deepseek2 file's attn_k_b / attn_v_b blocks (weights.py)
LATENT_BLOCKS = (".w_uk_blocks", ".w_uv_blocks")


def _load_gguf_blocks(
    model: nn.Module,
    p: Path,
    arch: ArchConfig,
    gguf_arch: str,
    dtype: torch.dtype,
    shard: ShardPlan | None = None,
    huge_pages: bool = True,
) -> dict[str, torch.Tensor]:
    """Swap every linear and embedding whose GGUF tensor has a kernel-readable block type for a
    module over the file's blocks; returns the remaining (float) tensors for load_state_dict."""
    from tidal.loader.weights import iter_gguf_weights
    from tidal.quant.gguf_blocks import GGUFEmbedding, GGUFLinear

    modules = dict(model.named_modules())

    def swappable(hf: str) -> bool:
        owner = modules.get(hf.removesuffix(".weight"))
        return hf.endswith(".weight") and isinstance(owner, nn.Linear | nn.Embedding)

    expected = dict(model.state_dict(keep_vars=True))
    state: dict[str, torch.Tensor] = {}
    blocks = {}
    weights = iter_gguf_weights(p, arch, gguf_arch, keep_blocks=swappable, huge_pages=huge_pages)
    for name, tensor in weights:
        if name.endswith(LATENT_BLOCKS) and shard is None:  # MLA's absorbed decode weights
            owner = modules.get(name.rpartition(".")[0])
            if owner is not None and hasattr(owner, "set_latent_blocks"):
                owner.set_latent_blocks(name.rpartition(".")[2], tensor)
            continue
        if name not in expected:
            continue
        part = None if shard is None else shard.slice_of(name)
        if part is not None:
            if isinstance(tensor, torch.Tensor):
                tensor = slice_tensor(tensor, part)
            else:
                tensor = slice_blocks(tensor, part, name)
        want = tuple(expected[name].shape)
        got = (tensor.rows, tensor.cols) if not isinstance(tensor, torch.Tensor) else tensor.shape
        if tuple(got) != want:
            raise ValueError(f"{p}: tensor {name} has shape {tuple(got)}, expected {want}")
        if isinstance(tensor, torch.Tensor):
            state[name] = tensor.to(dtype=dtype)
        else:
            blocks[name.removesuffix(".weight")] = tensor
    if _tied(model):  # as _read_state: a tied model ignores any output.weight
        state.pop("lm_head.weight", None)
        blocks.pop("lm_head", None)
        if "model.embed_tokens" in blocks:  # the head reads the embedding's blocks: one table
            blocks["lm_head"] = blocks["model.embed_tokens"]
    for path, weight in blocks.items():
        parent_name, _, attr = path.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        if isinstance(modules[path], nn.Embedding):
            setattr(parent, attr, GGUFEmbedding(weight, dtype))
        else:
            bias = state.pop(f"{path}.bias", None)
            setattr(parent, attr, GGUFLinear([weight], bias, dtype))
    return state


def _read_state(
    p: Path,
    arch: ArchConfig,
    gguf_arch: str | None,
    expected: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    shard: ShardPlan | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors the model uses, renamed, shape-checked, in `dtype` on `device`;
    with `shard`, only this rank's slices (safetensors read only those bytes)."""
    if p.is_dir():
        from tidal.loader.weights import iter_safetensors_weights

        weights = iter_safetensors_weights(p, None if shard is None else shard.slice_of)
    else:
        from tidal.loader.weights import iter_gguf_weights

        assert gguf_arch is not None
        weights = iter_gguf_weights(p, arch, gguf_arch)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name not in expected:
            continue  # e.g. vision tower of a multimodal checkpoint
        part = None if shard is None or p.is_dir() else shard.slice_of(name)
        if part is not None:  # GGUF: decoded whole, then cut (safetensors came cut)
            tensor = slice_tensor(tensor, part)
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{p}: tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
        state[name] = tensor.to(device=device, dtype=dtype)
    if arch.tie_word_embeddings or arch.family == "gemma3":
        state.pop("lm_head.weight", None)
    return state


def _fits(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype
) -> bool:
    """Every cached tensor is one the model has, with its shape and the wanted dtype."""
    return all(
        name in expected and t.shape == expected[name].shape and t.dtype == dtype
        for name, t in state.items()
    )


def _tied(model: nn.Module) -> bool:
    arch: ArchConfig = model.arch  # type: ignore[assignment]
    return arch.tie_word_embeddings or arch.family == "gemma3"
