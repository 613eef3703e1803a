"""`gguf_gemm`, `dequantize_rows`, `dequantize_gather`: CPU matmuls and row decoding on GGUF blocks."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tidal.kernels.build import cpu_flags, load
from tidal.kernels.isa import ISA_CPU_FLAGS, ISA_NAMES, PATH_ORDER, default_path, library_paths

# ggml type numbers as in tidal.quant.gguf_types.GGMLType (an IntEnum: its members work here;
# kernels/ sits below loader/ in the layering, hence plain ints): name, elements, bytes per block.
_BLOCKS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    6: ("Q5_0", 32, 22),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
}
# Values per scale of the "q8" activations' int8 rows: 32 for every type, the K-quants included
# (ggml's Q8_K has one scale per 256 there: +0.32% perplexity on the bundled model's gate against
# +0.12% with one per 32, docs/quantization.md).
Q8_GROUP: dict[int, int] = dict.fromkeys(_BLOCKS, 32)
SUPPORTED_TYPES: frozenset[int] = frozenset(_BLOCKS)
MAX_SEGMENTS = 4
ACTS = ("f32", "q8")
_ACT_CODES = {"f32": 0, "q8": 1}
# scalar 0, avx2 1, avx512 2 (AVX-512 F/BW/VL with VNNI), and this kernel's own avx2vnni 3 and
# amx 4 (tidal/kernels/gguf_amx.h)
_ISA_CODES = {**ISA_NAMES, "avx2vnni": 3, "amx": 4}
_ERRORS = {-1: "unsupported ggml type", -2: "bad shape", -3: "ISA not built", -4: "no memory"}

# NOTE: every argument crosses as c_void_p (the C side takes pointers and int64_t): ctypes
# converts a Python int to c_void_p ~5x faster than to c_int64, and on x86-64 and aarch64 both
# travel as one 64-bit word. Only non-negative integers are passed.
_word = ctypes.c_void_p
_MOVED = (
    "a weight's blocks moved (e.g. share_memory_()) after its BlockWeight was built: rebuild it"
)
_profiling = torch.autograd._profiler_enabled
_record = torch.profiler.record_function


def _descriptor(args: Sequence[int]) -> tuple[ctypes.Array, int]:
    """(pointer, ggml type, rows) per weight as int64, what the C side reads for its segments:
    the array (keep it alive) and its address."""
    desc = (ctypes.c_int64 * len(args))(*args)
    return desc, ctypes.addressof(desc)


def _describe(weights: Sequence[BlockWeight]) -> tuple[ctypes.Array, int, int, int, int]:
    """An ad-hoc list of weights, checked, as (descriptor, its address, count, rows, cols): the
    per-call path (~1 us more than a prepared BlockSegments)."""
    if not 1 <= len(weights) <= MAX_SEGMENTS:
        raise ValueError(f"segments: {len(weights)} given; 1 to {MAX_SEGMENTS} accepted")
    args: list[int] = []
    for w in weights:
        if type(w) is not BlockWeight:
            raise ValueError(f"segments must be BlockWeights; got {type(w).__name__}")
        if w.blocks.data_ptr() != w._args[0]:
            raise ValueError(_MOVED)
        if w.cols != weights[0].cols:
            raise ValueError(f"segments must share cols; got {[w.cols for w in weights]}")
        args += w._args
    desc, address = _descriptor(args)
    return desc, address, len(weights), sum(args[2::3]), weights[0].cols


@dataclass(frozen=True, slots=True, eq=False)
class BlockWeight:
    """A weight matrix (rows, cols) kept in a GGUF block format: `blocks` is (rows, row_bytes)
    uint8, contiguous, each row its blocks exactly as stored in the file. The data pointer is read
    here, once, and checked on every call (a storage moved in place raises)."""

    blocks: torch.Tensor
    ggml_type: int
    rows: int
    cols: int
    _args: tuple[int, int, int] = field(init=False, repr=False)
    _desc: ctypes.Array = field(init=False, repr=False)
    _desc_ptr: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        spec = _BLOCKS.get(int(self.ggml_type))
        if spec is None:
            raise ValueError(
                f"ggml_type {self.ggml_type!r} is not supported; supported: "
                f"{', '.join(f'{name} ({t})' for t, (name, _, _) in _BLOCKS.items())}"
            )
        name, elems, nbytes = spec
        if self.cols <= 0 or self.cols % elems:
            raise ValueError(f"cols {self.cols}: {name} needs a positive multiple of {elems}")
        row_bytes = self.cols // elems * nbytes
        b = self.blocks
        if b.dtype != torch.uint8 or b.device.type != "cpu" or not b.is_contiguous():
            raise ValueError(
                f"blocks must be a contiguous CPU uint8 tensor; got {b.dtype} on {b.device}, "
                f"contiguous={b.is_contiguous()}"
            )
        if tuple(b.shape) != (self.rows, row_bytes):
            raise ValueError(
                f"blocks shape {tuple(b.shape)} != (rows, row_bytes) = ({self.rows}, "
                f"{row_bytes}) for {name} with cols {self.cols}"
            )
        args = (b.data_ptr(), int(self.ggml_type), self.rows)
        desc, address = _descriptor(args)
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_desc", desc)
        object.__setattr__(self, "_desc_ptr", address)

    @classmethod
    def from_raw(cls, raw: torch.Tensor, ggml_type: int, rows: int, cols: int) -> BlockWeight:
        """From a tensor's stored bytes in any uint8 layout (e.g. a GGUF reader's flat view)."""
        return cls(raw.reshape(rows, -1), ggml_type, rows, cols)

    @property
    def row_bytes(self) -> int:
        return self.blocks.shape[1]


@dataclass(frozen=True, slots=True, eq=False)
class BlockSegments(Sequence[BlockWeight]):
    """1 to 4 block weights sharing cols, prepared once for fused calls (q/k/v, gate/up, whose
    types may differ): their outputs go side by side, `rows` columns in all."""

    weights: tuple[BlockWeight, ...]
    rows: int = field(init=False)
    cols: int = field(init=False)
    nseg: int = field(init=False)
    _desc: ctypes.Array = field(init=False, repr=False)
    _desc_ptr: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ws = tuple(self.weights)
        desc, address, nseg, rows, cols = _describe(ws)
        for name, value in (("weights", ws), ("rows", rows), ("cols", cols), ("nseg", nseg),
                            ("_desc", desc), ("_desc_ptr", address)):  # fmt: skip
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return len(self.weights)

    def __getitem__(self, i: int) -> BlockWeight:  # type: ignore[override]
        return self.weights[i]

    def __iter__(self) -> Iterator[BlockWeight]:
        return iter(self.weights)


# gguf_gemm.c's library and every library that links it in: the decode-step K-quant kernels are
# their own sources (one file per ISA), called from gguf_gemm.c
SOURCES = ("gguf_gemm", "gguf_kdecode_avx512", "gguf_kdecode_avx2")


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load(SOURCES[0], link=SOURCES[1:])
    if lib is None:
        return None
    lib.tidal_gguf_gemm.restype = ctypes.c_int
    # x, M, K, ldx, segments, nseg, y, ldy, act, isa, threads
    lib.tidal_gguf_gemm.argtypes = [_word] * 11
    lib.tidal_gguf_gemm_jobs.restype = ctypes.c_int
    # x, T, K, ldx, jobs, njobs, rows, y, ldy, isa, threads
    lib.tidal_gguf_gemm_jobs.argtypes = [_word] * 11
    lib.tidal_gguf_gemm_panels.restype = ctypes.c_int
    # x, M, K, ldx, segments, nseg, y, ldy, threads
    lib.tidal_gguf_gemm_panels.argtypes = [_word] * 9
    lib.tidal_gguf_dequantize.restype = ctypes.c_int
    # blocks, ggml type, K, ids or NULL, start, count, out, ldo, isa, threads
    lib.tidal_gguf_dequantize.argtypes = [_word] * 10
    return lib


def available() -> bool:
    return _library() is not None


@functools.cache
def isas() -> list[str]:
    """The kernel paths this machine runs, best first, "scalar" last ([] without the library):
    avx2vnni where the library was built with AVX-VNNI and the CPU has it, amx where it was
    built with AMX, the CPU has it and the OS grants the process its tile state."""
    lib = _library()
    paths = library_paths(lib, "tidal_gguf")
    for name in ("avx2vnni", "amx") if lib is not None else ():
        # NOTE: the flags first: tidal_gguf_has_amx() asks the OS for the tile state
        if ISA_CPU_FLAGS[name] <= cpu_flags() and getattr(lib, f"tidal_gguf_has_{name}")():
            paths.append(name)
    return sorted(paths, key=lambda name: -PATH_ORDER.index(name))


@functools.cache
def default_isa() -> str:
    """The best path, lowered by env TIDAL_KERNEL_ISA (read once per process): the best one
    at or below the path it names (=avx2 on an AVX-512 machine runs AVX2, =scalar plain C)."""
    return default_path(isas())


@functools.cache
def _runnable() -> dict[str, int]:
    return {name: _ISA_CODES[name] for name in isas()}


def _isa_code(isa: str | None) -> int:
    code = _runnable().get(default_isa() if isa is None else isa)
    if code is None:
        raise ValueError(f"isa {isa!r} cannot run here; this machine runs: {isas()}")
    return code


def _check(rc: int, what: str) -> None:
    if rc == -4:
        raise MemoryError(f"{what}: allocating the quantized activations failed")
    if rc != 0:
        raise RuntimeError(f"{what}: kernel returned {rc} ({_ERRORS.get(rc, 'unknown')})")


def gguf_gemm(
    x: torch.Tensor,
    segments: BlockWeight | BlockSegments | Sequence[BlockWeight],
    act: str = "f32",
    isa: str | None = None,
    *,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor | None:
    """(M, K) float32 x against 1 to 4 block weights of K cols -> (M, sum of rows) float32:
    x @ W_s.T side by side, segment s in the columns after those of segments 0..s-1.

    act "f32" multiplies float32 x with the decoded weights; "q8" quantizes the rows of x to int8
    first (faster with many rows; ~1e-3 relative difference). Row m of the result is bit-identical
    whatever else is in the batch and whatever the thread count. `out`, if given, is written and
    returned: CPU float32 (M, sum of rows) with unit inner stride (e.g. a column slice of a wider
    buffer). A BlockWeight or a BlockSegments prepared once is the cheapest to pass; a list is
    checked on every call. None where the kernel cannot take x (no library, not a CPU float32
    matrix with unit inner stride): the caller runs its fallback."""
    lib = _library()
    if lib is None:
        return None
    code = _ACT_CODES.get(act)
    if code is None:
        raise ValueError(f"act {act!r}; accepted: {', '.join(ACTS)}")
    tail = (code, _isa_code(isa), threads or torch.get_num_threads())
    return _matmul(lib.tidal_gguf_gemm, "tidal::gguf_gemm", x, segments, out, tail)


def _matmul(
    entry: Callable[..., int],
    name: str,
    x: torch.Tensor,
    segments: BlockWeight | BlockSegments | Sequence[BlockWeight],
    out: torch.Tensor | None,
    tail: tuple[int, ...],
) -> torch.Tensor | None:
    """One call of a block-matmul entry point (x, M, K, ldx, segments, nseg, y, ldy, *tail),
    under the profiler's `name` when it records; None where x is not a CPU float32 matrix with
    unit inner stride."""
    if x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2:
        return None
    m, k = x.shape
    ldx, inner = x.stride()
    if inner != 1 and k != 1:
        return None
    desc, nseg, n, keep = _segments_arg(segments, k)
    out = _out_arg(out, m, n)
    call = (
        x.data_ptr(), m, k, ldx if m > 1 else k, desc, nseg, out.data_ptr(),
        out.stride(0) if m > 1 else n, *tail,
    )  # fmt: skip
    if _profiling():
        with _record(name):
            rc = entry(*call)
    else:
        rc = entry(*call)
    del keep  # (the ad-hoc descriptor array lived through the call)
    if rc:
        _check(rc, name.removeprefix("tidal::"))
    return out


def _segments_arg(
    segments: BlockWeight | BlockSegments | Sequence[BlockWeight], k: int
) -> tuple[int, int, int, object]:
    """(descriptor pointer, segment count, total rows, what must stay alive through the call)."""
    kind = type(segments)
    if kind is not BlockWeight and kind is not BlockSegments and len(segments) == 1:
        segments = segments[0]  # a list of one: its weight's own descriptor
        kind = type(segments)
    if kind is BlockWeight:
        if segments.blocks.data_ptr() != segments._args[0]:
            raise ValueError(_MOVED)
        desc, nseg, n, cols, keep = segments._desc_ptr, 1, segments.rows, segments.cols, None
    elif kind is BlockSegments:
        for w in segments.weights:
            if w.blocks.data_ptr() != w._args[0]:
                raise ValueError(_MOVED)
        desc, nseg, n, cols, keep = (
            segments._desc_ptr, segments.nseg, segments.rows, segments.cols, None
        )  # fmt: skip
    else:
        keep, desc, nseg, n, cols = _describe(segments)
    if cols != k:
        raise ValueError(f"x has K={k} columns but the weights have cols={cols}")
    return desc, nseg, n, keep


def _out_arg(out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    if out is None:
        return torch.empty((m, n), dtype=torch.float32)
    if (
        out.dtype is not torch.float32
        or not out.is_cpu
        or tuple(out.shape) != (m, n)
        or (out.stride(1) != 1 and n > 1)
    ):
        raise ValueError(
            f"out must be CPU float32 ({m}, {n}) with unit inner stride; got {out.dtype} "
            f"{tuple(out.shape)} strides {out.stride()} on {out.device}"
        )
    return out


JOB_WORDS = 2 + 3 * MAX_SEGMENTS  # gguf_gemm.c's words per job


def gguf_gemm_jobs(
    x: torch.Tensor,
    jobs: Sequence[BlockSegments | None],
    counts: Sequence[int],
    rows: torch.Tensor,
    isa: str | None = None,
    *,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor | None:
    """Many products in one kernel call, with the "q8" activations: job j multiplies the
    `counts[j]` rows of x (T, K) listed next in `rows` (int64) by `jobs[j]`'s weights, into the
    next `counts[j]` rows of the result, its segments side by side as gguf_gemm writes them.
    The result is `out` if given (CPU float32, contiguous, (sum of counts, N) with N at least the
    widest job's rows), else a new tensor as wide as the widest job; a job's columns past its
    rows, and every row of a None job, are left as they were (a caller computes those another
    way). Each output row is bit-identical to gguf_gemm(x[rows], jobs[j], "q8") on any path. A
    mixture of experts runs a step's experts this way: a job an expert, its rows the tokens
    routed to it. None where the kernel cannot take x (no library, not a CPU float32 matrix with
    unit inner stride)."""
    lib = _library()
    if lib is None or x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2:
        return None
    t, k = x.shape
    if x.stride(1) != 1 and k != 1:
        return None
    if len(jobs) != len(counts):
        raise ValueError(f"{len(jobs)} jobs but {len(counts)} counts")
    total = sum(counts)
    if rows.dtype is not torch.int64 or rows.dim() != 1 or rows.numel() != total:
        raise ValueError(f"rows must be int64 ({total},); got {rows.dtype} {tuple(rows.shape)}")
    rows = rows.contiguous()
    words: list[int] = []
    width = 0
    for job, n in zip(jobs, counts, strict=True):
        if job is None:
            words += [0, int(n), *[0] * (JOB_WORDS - 2)]
            continue
        _segments_arg(job, k)  # checked as gguf_gemm checks its weights
        args = list(job._desc)  # the (pointer, type, rows) triples
        words += [job.nseg, int(n), *args, *[0] * (JOB_WORDS - 2 - len(args))]
        width = max(width, job.rows)
    if out is None:
        out = torch.empty((total, width), dtype=torch.float32)
    elif (out.dtype is not torch.float32 or not out.is_cpu or not out.is_contiguous()
          or out.dim() != 2 or out.shape[0] != total or out.shape[1] < width):  # fmt: skip
        raise ValueError(
            f"out must be CPU float32, contiguous, ({total}, >= {width}); got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    desc = (ctypes.c_int64 * len(words))(*words)
    call = (x.data_ptr(), t, k, x.stride(0) if t > 1 else k, ctypes.addressof(desc), len(jobs),
            rows.data_ptr(), out.data_ptr(), out.shape[1], _isa_code(isa),
            threads or torch.get_num_threads())  # fmt: skip
    if _profiling():
        with _record("tidal::gguf_gemm_jobs"):
            rc = lib.tidal_gguf_gemm_jobs(*call)
    else:
        rc = lib.tidal_gguf_gemm_jobs(*call)
    if rc:
        _check(rc, "gguf_gemm_jobs")
    return out


def gguf_gemm_panels(
    x: torch.Tensor,
    segments: BlockWeight | BlockSegments | Sequence[BlockWeight],
    *,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor | None:
    """gguf_gemm's float-activation product for prefill-sized x, on AVX2: 16 weight rows at a
    time decoded into a panel, every block of 6 rows of x through it in registers. Each output is
    one FMA chain over k in order, so row m is bit-identical whatever else is in x and whatever
    the thread count (its bits differ from gguf_gemm's, which sums each 32 values first). None
    where it cannot run (no library, no AVX2, x not a CPU float32 matrix with unit inner
    stride): the caller runs its fallback."""
    lib = _library()
    if lib is None or "avx2" not in isas():
        return None
    tail = (threads or torch.get_num_threads(),)
    return _matmul(lib.tidal_gguf_gemm_panels, "tidal::gguf_gemm_panels", x, segments, out, tail)


def _dequantize(
    weight: BlockWeight,
    ids: torch.Tensor | None,
    start: int,
    count: int,
    isa: str | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    lib = _library()
    if lib is None:
        return None
    if out is None:
        out = torch.empty((count, weight.cols), dtype=torch.float32)
    elif (
        out.dtype is not torch.float32
        or not out.is_cpu
        or tuple(out.shape) != (count, weight.cols)
        or out.stride(1) != 1
    ):
        raise ValueError(
            f"out must be CPU float32 ({count}, {weight.cols}) with unit inner stride; got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}"
        )
    if count == 0:
        return out
    call = (
        weight.blocks.data_ptr(), int(weight.ggml_type), weight.cols,
        None if ids is None else ids.data_ptr(), start, count, out.data_ptr(), out.stride(0),
        _isa_code(isa), torch.get_num_threads(),
    )  # fmt: skip
    if _profiling():
        with _record("tidal::gguf_dequantize"):
            rc = lib.tidal_gguf_dequantize(*call)
    else:
        rc = lib.tidal_gguf_dequantize(*call)
    _check(rc, "gguf_dequantize")
    return out


def dequantize_rows(
    weight: BlockWeight,
    start: int,
    stop: int,
    isa: str | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Rows [start, stop) of the weight as (stop - start, cols) float32, bit-exact with gguf-py's
    dequantize; written into `out` if given (CPU float32 of that shape with unit inner stride,
    e.g. rows of a wider buffer) and returned. None without the library (the caller decodes in
    torch)."""
    if not 0 <= start <= stop <= weight.rows:
        raise ValueError(f"rows [{start}, {stop}) outside 0..{weight.rows}")
    return _dequantize(weight, None, start, stop - start, isa, out)


def dequantize_gather(
    weight: BlockWeight, ids: torch.Tensor, isa: str | None = None
) -> torch.Tensor | None:
    """Rows `ids` (1-D int64 CPU) as (len(ids), cols) float32, bit-exact: an embedding lookup on
    the packed table; None without the library."""
    if ids.dtype != torch.int64 or ids.dim() != 1 or ids.device.type != "cpu":
        raise ValueError(f"ids must be a 1-D CPU int64 tensor; got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= weight.rows:
            raise ValueError(f"ids span {lo}..{hi}; rows are 0..{weight.rows - 1}")
    ids = ids.contiguous()
    return _dequantize(weight, ids, 0, ids.numel(), isa)
