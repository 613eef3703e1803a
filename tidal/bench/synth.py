"""`tidal bench synth`: layout twins, GGUF files with a real model's layout and synthetic weights.

A layout twin holds what an engine's speed on a model depends on: the GGUF metadata that sets the
architecture, and every tensor's name, shape and ggml block type, in llama.cpp's order, so every
matmul reads what it would read in the real file (whose size the twin's matches to within the
tokenizer's few MB). Its weights are random, zero-mean values of a 7B model's spread
(tidal/bench/twin_weights.py) and its tokenizer is a stand-in: a twin measures tokens/s and GB/s
on a 7B-class model without downloading one; its text is noise, so it says nothing about quality
(perplexity, accuracy, output text).

Two sources of a layout:
  `deepseek-r1-distill-qwen-7b-q4_k_m`  the real file's header (tidal/bench/twin_donor.py): every
      metadata key byte for byte (its real tokenizer and chat template) and every tensor info;
      only the tensor data is synthesized.
  ARCH-RECIPE, e.g. `llama-3.1-8b-q4_k_m`  the table (tidal/bench/twin_layouts.py): the model's
      exact hyperparameters and llama-quantize's types for the recipe. The tokenizer is the
      DeepSeek header's (Qwen2's byte-level BPE) cut or padded to the model's vocabulary size
      (tidal/bench/twin_tokenizer.py): the vocabulary's size is the model's, its tokens are not.

    tidal bench synth qwen2.5-7b-q4_k_m          # -> ~/.cache/tidal/twins/qwen2.5-7b-q4_k_m.gguf
    tidal bench synth qwen3-8b-q8_0 --layers 2 --tiny --tokenizer bytes   # seconds, offline

Files go to `<tidal cache>/twins/NAME.gguf` with a `NAME.gguf.twin.json` beside it recording the
recipe; a twin whose file and record match is kept, not written again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tidal.bench.twin_donor import DONOR_NAME, DonorUnavailable, read_donor_header
from tidal.bench.twin_header import (
    MetaValue,
    TensorSpec,
    alignment_of,
    encode_header,
    meta,
    replace_value,
)
from tidal.bench.twin_layouts import (
    ARCHITECTURES,
    RECIPES,
    keep_layers,
    llama3_rope_factors,
    table_metadata,
    table_tensors,
)
from tidal.loader.cache_files import tidal_cache_dir, write_cache_file

FORMAT_VERSION = 1  # bump when the bytes a TwinSpec gives change: older twins are rewritten
TOKENIZERS = ("donor", "bytes")
SIDECAR_SUFFIX = ".twin.json"


@dataclass(frozen=True, slots=True)
class TwinSpec:
    """What a twin is made of; its name (and file name) follows from it."""

    layout: str  # DONOR_NAME (the header) or an ARCHITECTURES key (the table)
    recipe: str | None = None  # a RECIPES key; None for the header, whose types are its own
    num_layers: int | None = None  # keep the first N layers (block_count = N)
    vocab_size: int | None = None  # the table's vocabulary size, overridden
    tiny: bool = False  # the architecture at test size (Architecture.tiny)
    tokenizer: str = "donor"  # "donor": the DeepSeek header's; "bytes": offline byte-level BPE

    @property
    def name(self) -> str:
        parts = [self.layout, "tiny" if self.tiny else None, self.recipe,
                 f"l{self.num_layers}" if self.num_layers is not None else None,
                 f"v{self.vocab_size}" if self.vocab_size is not None else None,
                 "bytetok" if self.tokenizer == "bytes" else None]  # fmt: skip
        return "-".join(p for p in parts if p)


@dataclass(slots=True)
class TwinPlan:
    """A twin before its data is written: the header's parts and the fixed tensor values."""

    metadata: list[MetaValue]
    tensors: list[TensorSpec]
    values: dict[str, list[float]] = field(default_factory=dict)


def parse_name(name: str) -> tuple[str, str | None]:
    """`deepseek-r1-distill-qwen-7b-q4_k_m` (the header) or ARCH-RECIPE -> (layout, recipe)."""
    if name == DONOR_NAME:
        return name, None
    for recipe in RECIPES:
        arch = name.removesuffix(f"-{recipe}")
        if arch != name and arch in ARCHITECTURES:
            return arch, recipe
    raise ValueError(f"twin {name!r} is unknown; expected {DONOR_NAME} or ARCH-RECIPE with ARCH "
                     f"one of {sorted(ARCHITECTURES)} and RECIPE one of {sorted(RECIPES)}")  # fmt: skip


def twin_dir() -> Path:
    return tidal_cache_dir() / "twins"


def plan_twin(spec: TwinSpec) -> TwinPlan:
    """The twin's metadata and tensor infos (reads the donor header, fetching it if needed)."""
    _check(spec)
    values: dict[str, list[float]] = {}
    if spec.layout == DONOR_NAME:
        header = read_donor_header()
        metadata, tensors = list(header.metadata), list(header.tensors)
    else:
        from tidal.bench.twin_tokenizer import byte_tokenizer, donor_tokenizer

        arch = ARCHITECTURES[spec.layout].tiny() if spec.tiny else ARCHITECTURES[spec.layout]
        if spec.vocab_size is not None:
            arch = replace(arch, vocab_size=spec.vocab_size)
        recipe = RECIPES[spec.recipe or ""]
        tensors = table_tensors(arch, recipe)
        note = (f"tidal layout twin {spec.name}: {arch.title}'s tensor layout and {recipe.name} "
                "types; synthetic weights and a stand-in tokenizer")  # fmt: skip
        head, tail = table_metadata(arch, recipe, note)
        if spec.tokenizer == "bytes":
            tokenizer = byte_tokenizer(arch.vocab_size)
        else:
            tokenizer = donor_tokenizer(read_donor_header(), arch.vocab_size)
        metadata = head + tokenizer + tail
        if arch.llama3_rope is not None:
            values["rope_freqs.weight"] = llama3_rope_factors(arch)
    if spec.num_layers is not None:
        arch_name = next(m.value() for m in metadata if m.key == "general.architecture")
        count = next(m for m in metadata if m.key == f"{arch_name}.block_count")
        if spec.num_layers > count.value():
            raise ValueError(f"num_layers={spec.num_layers}: {spec.layout} has {count.value()}")
        tensors = keep_layers(tensors, spec.num_layers)
        metadata = replace_value(metadata, meta(count.key, spec.num_layers, count.vtype))
    return TwinPlan(metadata, tensors, values)


def synthesize(
    spec: TwinSpec, output: Path | None = None, force: bool = False, quiet: bool = False
) -> Path:
    """Write the twin (streamed tensor by tensor) and return its path; a twin already there with
    the same record is kept unless `force`."""
    path = Path(output) if output is not None else twin_dir() / f"{spec.name}.gguf"
    sidecar = path.with_name(path.name + SIDECAR_SUFFIX)
    record = {"format": FORMAT_VERSION, "name": spec.name, "spec": asdict(spec)}
    if not force and _is_current(path, sidecar, record):
        return path
    start = time.perf_counter()
    plan = plan_twin(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_twin(plan, path, seed=zlib.crc32(spec.name.encode()))
    st = path.stat()
    record.update(bytes=st.st_size, mtime_ns=st.st_mtime_ns)
    write_cache_file(sidecar, [json.dumps(record, indent=1).encode()])
    if not quiet:
        print(f"wrote {spec.name}: {len(plan.tensors)} tensors, {st.st_size / 1e9:.3f} GB in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)  # fmt: skip
    return path


def write_twin(plan: TwinPlan, path: Path, seed: int = 0) -> None:
    """The header, then each tensor's synthetic bytes at its aligned offset; written under a
    temporary name and renamed, so a half-written twin is never found."""
    from tidal.bench.twin_weights import CHUNK_BYTES, RandomBytes, tensor_chunks

    header, offsets = encode_header(plan.metadata, plan.tensors)
    largest = max((t.nbytes for t in plan.tensors), default=0)
    source = RandomBytes(seed, chunk_bytes=max(4096, min(CHUNK_BYTES, largest)))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            pos = 0  # in the data section
            for spec, offset in zip(plan.tensors, offsets, strict=True):
                f.write(bytes(offset - pos))  # the alignment's padding
                for chunk in tensor_chunks(spec, source, plan.values.get(spec.name)):
                    f.write(chunk.data)
                pos = offset + spec.nbytes
            f.write(bytes(-pos % alignment_of(plan.metadata)))  # llama.cpp pads the last one too
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check(spec: TwinSpec) -> None:
    if spec.tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer={spec.tokenizer!r}; expected one of {TOKENIZERS}")
    if spec.num_layers is not None and spec.num_layers < 1:
        raise ValueError(f"num_layers={spec.num_layers}; expected 1 or more")
    if spec.layout == DONOR_NAME:
        if spec.recipe or spec.tiny or spec.vocab_size or spec.tokenizer != "donor":
            raise ValueError(f"{DONOR_NAME} is the real header: its types, sizes and tokenizer "
                             "are its own (only --layers applies)")  # fmt: skip
    elif spec.layout not in ARCHITECTURES or spec.recipe not in RECIPES:
        raise ValueError(f"layout={spec.layout!r} recipe={spec.recipe!r}; expected one of "
                         f"{sorted(ARCHITECTURES)} and one of {sorted(RECIPES)}")  # fmt: skip


def _is_current(path: Path, sidecar: Path, record: dict) -> bool:
    try:
        saved = json.loads(sidecar.read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    same_file = saved.get("bytes") == st.st_size and saved.get("mtime_ns") == st.st_mtime_ns
    return same_file and all(saved.get(k) == v for k, v in record.items())


# ---------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help=(
        f"{DONOR_NAME} (the real header) or ARCH-RECIPE, e.g. qwen2.5-7b-q4_k_m; --list shows "
        "them"))  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--vocab", type=int, default=None, help="table twins: this many tokens")
    p.add_argument("--tiny", action="store_true", help="table twins: 256 wide, 512 tokens (tests)")
    p.add_argument("--tokenizer", default="donor", choices=TOKENIZERS, help=(
        "table twins' stand-in: the DeepSeek header's BPE (one download), or a byte-level one"))  # fmt: skip
    p.add_argument("--output", default=None, help="write here, not to the cache's twins/")
    p.add_argument("--force", action="store_true", help="write even if the twin exists")
    p.add_argument("--list", action="store_true", help="list the layouts and recipes")


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(layouts_table())
        return 0
    if not args.name:
        raise ValueError("no twin named: expected NAME (see --list)")
    layout, recipe = parse_name(args.name)
    spec = TwinSpec(layout, recipe, args.layers, args.vocab, args.tiny, args.tokenizer)
    try:
        path = synthesize(spec, Path(args.output) if args.output else None, args.force)
    except DonorUnavailable as e:
        raise ValueError(f"{e} (--tokenizer bytes makes a table twin offline)") from None
    print(path)
    return 0


def layouts_table() -> str:
    rows = ["| twin | arch | layers | hidden | ffn | heads / kv | head dim | vocab | notes |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {DONOR_NAME} | qwen2 | 28 | 3584 | 18944 | 28 / 4 | 128 | 152064 | the real "
            "header: metadata and tensor infos byte for byte |"]  # fmt: skip
    for a in ARCHITECTURES.values():
        notes = ", ".join(n for n, on in (("qkv bias", a.qkv_bias), ("q/k norm", a.qk_norm),
                          ("llama3 rope_freqs", a.llama3_rope is not None),
                          ("tied output", a.tied_embeddings),
                          ("MLA (latent 512 + 64), YaRN", a.mla is not None),
                          (f"{a.experts.count} experts ({a.experts.used} a token) + "
                           f"{a.experts.shared} shared of {a.experts.intermediate_size}"
                           if a.experts else "", a.experts is not None)) if on)  # fmt: skip
        rows.append(f"| {a.name}-RECIPE | {a.gguf_arch} | {a.num_layers} | {a.hidden_size} | "
                    f"{a.intermediate_size} | {a.num_heads} / {a.num_kv_heads} | {a.head_dim} | "
                    f"{a.vocab_size} | rope theta {a.rope_theta:,.0f}{', ' if notes else ''}{notes} |")  # fmt: skip
    rows.append(f"\nRECIPE: {', '.join(RECIPES)} (llama-quantize's types for each)")
    return "\n".join(rows)
