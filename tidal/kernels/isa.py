"""The kernels' code paths (instruction sets): one name and code each, and the TIDAL_KERNEL_ISA ceiling."""

from __future__ import annotations

import ctypes
import os

from tidal.kernels.build import cpu_flags

# The `isa` argument every C kernel takes; a higher code needs everything a lower one does.
# A kernel without a path for some code runs its best one below it (the decoder's elementwise
# helpers stop at AVX2; paged attention has AVX-512 F/BW/VL/DQ, the GGUF matmuls AVX-512 with VNNI).
ISA_SCALAR, ISA_AVX2, ISA_AVX512 = 0, 1, 2
ISA_NAMES: dict[str, int] = {"scalar": ISA_SCALAR, "avx2": ISA_AVX2, "avx512": ISA_AVX512}
# Paths one kernel adds between the shared ones, with the shared code the rest of its work and
# every other kernel take under that name: gguf_gemm's "avx2vnni" is AVX2 with AVX-VNNI's
# vpdpbusd for its integer sums (Intel cores from Alder Lake on, the E-core Xeons); its "amx" is
# AVX-512 with the AMX tile unit for the int8 sums of batches of 6 or 12 rows and more, by block
# type (Xeons from Sapphire Rapids on).
EXTRA_PATHS: dict[str, int] = {"avx2vnni": ISA_AVX2, "amx": ISA_AVX512}
# Every path name, lowest first: the order in which TIDAL_KERNEL_ISA's ceiling compares them.
PATH_ORDER = ("scalar", "avx2", "avx2vnni", "avx512", "amx")
# /proc/cpuinfo flags (tidal.kernels.build.cpu_flags) a path needs to run
ISA_CPU_FLAGS: dict[str, frozenset[str]] = {
    "scalar": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx2vnni": frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "amx": frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
        | {"amx_tile", "amx_int8"}
    ),
}


def requested_path() -> str | None:
    """The path env TIDAL_KERNEL_ISA names, a ceiling on every kernel's default; None when
    unset. Raises ValueError for a name not in PATH_ORDER."""
    name = os.environ.get("TIDAL_KERNEL_ISA", "").strip().lower()
    if not name:
        return None
    if name not in PATH_ORDER:
        raise ValueError(
            f"TIDAL_KERNEL_ISA={name!r} is invalid: expected one of {list(PATH_ORDER)}"
        )
    return name


def requested_isa() -> int | None:
    """The shared code of TIDAL_KERNEL_ISA's path (an extra path's: the one it builds on);
    None when unset. Raises ValueError as requested_path does."""
    name = requested_path()
    if name is None:
        return None
    return ISA_NAMES[name] if name in ISA_NAMES else EXTRA_PATHS[name]


def capped_isa(best: int) -> int:
    """`best` (a kernel's best built path), lowered to TIDAL_KERNEL_ISA's ceiling if set."""
    ceiling = requested_isa()
    return best if ceiling is None else min(best, ceiling)


def runnable_paths(built: dict[str, bool], flags: frozenset[str]) -> list[str]:
    """The paths a library reports as `built` whose CPU `flags` this machine has, best first,
    "scalar" (always built) last."""
    names = sorted(built, key=lambda name: -ISA_NAMES[name])
    return [*(n for n in names if built[n] and ISA_CPU_FLAGS[n] <= flags), "scalar"]


def library_paths(lib: ctypes.CDLL | None, prefix: str) -> list[str]:
    """The paths a kernel library runs here, best first, "scalar" last ([] without the
    library): each path P it reports built through `<prefix>_has_P()` (where it defines one)
    whose CPU flags this machine has."""
    if lib is None:
        return []
    built = {}
    for name in ("avx512", "avx2"):
        has = getattr(lib, f"{prefix}_has_{name}", None)
        if has is not None:
            has.restype = ctypes.c_int
            built[name] = bool(has())
    return runnable_paths(built, cpu_flags())


def default_path(paths: list[str]) -> str:
    """The best of `paths` (best first, as runnable_paths gives them) at or below
    TIDAL_KERNEL_ISA's ceiling: =avx2 on an AVX-512 machine runs AVX2, =scalar plain C."""
    paths = paths or ["scalar"]
    ceiling = requested_path()
    if ceiling is None:
        return paths[0]
    top = PATH_ORDER.index(ceiling)
    return next(name for name in paths if PATH_ORDER.index(name) <= top)
