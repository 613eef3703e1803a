"""GateVerdict: the accuracy gate's result stored beside the model, so later starts skip the gate."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.kernels.build import identity

if TYPE_CHECKING:
    from tidal.worker.gate import GateReport

log = logging.getLogger("tidal.worker.gate")

# Bump when the gate's arithmetic or held-out scoring changes, so old verdicts stop matching.
# 2: GGUF-block schemes are measured against the same blocks in float mode; 3: gguf-q8's K-quants
# read activations with a scale per 32 values (was per 256), so its old verdicts are stale; 4:
# gguf-q8 scales each run's exact integer dot product in one FMA (was per lane, then a sum).
GATE_VERSION = 4


@dataclass(frozen=True, slots=True)
class GateVerdict:
    mode: str  # "int8", "kv-int8", "int4+kv-fp8"
    ppl_ref: float
    ppl_quant: float
    change_pct: float
    top1_agreement: float
    num_tokens: int
    threshold_pct: float
    passed: bool
    gate_s: float  # how long measuring took, to tell the user what the cache saves

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict} {self.mode}: ppl {self.ppl_ref:.4f} -> {self.ppl_quant:.4f} "
            f"({self.change_pct:+.3f}%, limit +{self.threshold_pct}%), "
            f"top-1 agreement {100 * self.top1_agreement:.2f}% over {self.num_tokens} tokens"
        )


def verdict_of(report: GateReport, gate_s: float) -> GateVerdict:
    return GateVerdict(
        report.scheme,
        report.ppl_ref,
        report.ppl_quant,
        report.change_pct,
        report.top1_agreement,
        report.num_tokens,
        report.threshold_pct,
        report.passed,
        gate_s,
    )


def model_identity(path: Path) -> str:
    """The checkpoint's resolved path with its files' sizes and mtimes: replacing the weights (a new
    download, a re-export) changes it; reading them does not. No hashing of 100s of MB."""
    p = path.resolve()
    # In a folder: the checkpoint's files, not the hidden ones (this module's verdict file).
    files = (
        sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
        if p.is_dir()
        else [p]
    )
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return json.dumps([str(p), stats])


def verdict_key(
    model_path: Path,
    scheme: str,
    kv_cache_dtype: str,
    threshold_pct: float,
    heldout: str,
    max_tokens: int | None = None,
) -> str:
    """sha256 over everything that decides the verdict, the kernels' build among it (a changed
    kernel, compiler or CPU gives other numbers)."""
    parts = [
        GATE_VERSION,
        identity(),
        model_identity(model_path),
        scheme,
        kv_cache_dtype,
        repr(float(threshold_pct)),
        hashlib.sha256(heldout.encode("utf-8")).hexdigest(),
        max_tokens,
    ]
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()


def verdict_file(model_path: Path) -> Path:
    """`model.gguf` -> `model.gguf.quant-gate.json` beside it; a model folder keeps it inside."""
    if model_path.is_dir():
        return model_path / ".tidal-quant-gate.json"
    return model_path.with_name(model_path.name + ".quant-gate.json")


def load_verdict(model_path: Path, key: str) -> GateVerdict | None:
    """The stored verdict for `key`, or None (no file, no entry, or an unreadable file)."""
    try:
        entries = json.loads(verdict_file(model_path).read_text(encoding="utf-8"))
        return GateVerdict(**entries[key])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_verdict(model_path: Path, key: str, verdict: GateVerdict) -> bool:
    """Add the verdict to the file (written to a temporary name, then renamed, so a concurrent
    start reads the old file or the new one). False when the folder is not writable."""
    path = verdict_file(model_path)
    try:
        entries = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = asdict(verdict)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the quantization gate's verdict in %s: %s", path, e)
        tmp.unlink(missing_ok=True)
        return False
    return True
