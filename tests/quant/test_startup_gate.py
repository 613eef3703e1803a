"""The start-up gate: a quantized mode is measured (or its stored verdict reused) before serving."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.tiny import make_tiny_model_dir
from tidal.cli import main as tidal_main
from tidal.engine.builder import build_engine
from tidal.engine.llm import engine_config_from_kwargs
from tidal.kernels import build
from tidal.worker.gate import GateFailed, heldout_text, run_gate
from tidal.worker.gate import main as gate_main
from tidal.worker.gate_cache import load_verdict, verdict_file, verdict_key

SMALL = {"kv_cache_bytes": 1 << 22, "quantization_gate_max_tokens": 64}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only contends on a shared box
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("gate_src"))


@pytest.fixture
def tiny_dir(tiny_src: Path, tmp_path: Path) -> Path:
    """A fresh copy per test, so no verdict is stored beside it yet."""
    return Path(shutil.copytree(tiny_src, tmp_path / "model"))


def _transformers_ppl(model: Path, max_tokens: int) -> float:
    """The independent reference for the gate's float perplexity: transformers (float32, eager)
    on the same checkpoint and the same held-out token ids, exp(mean NLL of each next token)."""
    from transformers import AutoModelForCausalLM

    from tidal.loader.tokenizer import load_tokenizer

    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager"
    )
    ids = load_tokenizer(model).encode(heldout_text())[:max_tokens]  # one context: 256 > 128
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].double()  # (T - 1, vocab)
    nll = torch.logsumexp(logits, -1) - logits.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return math.exp(nll.mean().item())


def _ppls(line: str) -> tuple[float, float, float]:
    """(float ppl, quantized ppl, change %) from a gate line 'PASS kv-int8: ppl A -> B (+C%, ...'."""
    m = re.search(r"ppl ([\d.]+) -> ([\d.]+) \(([+-][\d.]+)%", line)
    assert m is not None, line
    return float(m.group(1)), float(m.group(2)), float(m.group(3))


def _build(model: Path, messages: list[str], **kwargs: object):
    return build_engine(
        engine_config_from_kwargs(str(model), **SMALL, **kwargs), progress=messages.append
    )


def test_gate_runs_once_then_the_stored_verdict_is_reused(tiny_dir: Path) -> None:
    messages: list[str] = []
    _build(tiny_dir, messages, kv_cache_dtype="int8")
    measured = [m for m in messages if m.startswith("quantization gate (")]
    assert len(measured) == 1 and "PASS kv-int8" in measured[0], messages
    # The verdict beside the model holds the gate's own figures for this model and mode.
    key = verdict_key(tiny_dir, "none", "int8", 1.0, heldout_text(), 64)
    verdict = load_verdict(tiny_dir, key)
    report = run_gate(tiny_dir, "none", 1.0, max_tokens=64, kv_cache_dtype="int8")
    assert verdict is not None and verdict.passed and verdict.mode == "kv-int8"
    assert (verdict.ppl_ref, verdict.ppl_quant, verdict.num_tokens) == (
        pytest.approx(report.ppl_ref, rel=1e-12),
        pytest.approx(report.ppl_quant, rel=1e-12),
        63,
    )
    messages.clear()
    _build(tiny_dir, messages, kv_cache_dtype="int8")
    assert any(m.startswith("quantization gate (cached") for m in messages), messages
    assert not any(m.startswith("quantization gate: measuring") for m in messages)
    # Another mode is another entry, measured afresh.
    messages.clear()
    _build(tiny_dir, messages, quantization="int8", kv_cache_dtype="int8")
    assert any("measuring int8+kv-int8" in m for m in messages), messages
    assert len(json.loads(verdict_file(tiny_dir).read_text())) == 2


def test_a_failed_gate_refuses_to_start_unless_forced(tiny_dir: Path) -> None:
    # fp8 KV over 128 tokens of the tiny random model rises well above a 0.1% threshold.
    strict = {"kv_cache_dtype": "fp8", "quantization_gate_threshold_pct": 0.1}
    messages: list[str] = []
    with pytest.raises(GateFailed, match=r"refusing to serve kv-fp8: FAIL kv-fp8: ") as failed:
        build_engine(
            engine_config_from_kwargs(
                str(tiny_dir), kv_cache_bytes=1 << 22, quantization_gate_max_tokens=128, **strict
            ),
            progress=messages.append,
        )
    ppl_ref, ppl_quant, change_pct = _ppls(str(failed.value))
    # The float side is transformers' perplexity on the same tokens; the verdict is its own rule.
    assert ppl_ref == pytest.approx(_transformers_ppl(tiny_dir, 128), rel=1e-4)
    assert change_pct == pytest.approx(100 * (ppl_quant / ppl_ref - 1), abs=0.01)
    assert change_pct > 0.1 and "limit +0.1%" in str(failed.value)
    assert not any(m.startswith("loading") for m in messages)  # refused before loading
    forced = engine_config_from_kwargs(
        str(tiny_dir),
        kv_cache_bytes=1 << 22,
        quantization_gate_max_tokens=128,
        force_quantization=True,
        **strict,
    )
    messages.clear()
    build_engine(forced, progress=messages.append)  # serves; the cached FAIL is logged
    assert any("(cached" in m and "FAIL kv-fp8" in m for m in messages), messages


def test_disabled_gate_and_float_modes_measure_nothing(tiny_dir: Path) -> None:
    messages: list[str] = []
    _build(tiny_dir, messages, kv_cache_dtype="int8", quantization_gate=False)
    assert any("quantization gate disabled" in m for m in messages)
    _build(tiny_dir, messages)
    assert not any(m.startswith("quantization gate (") for m in messages)
    assert not verdict_file(tiny_dir).exists()


def test_verdict_key_follows_the_model_file_and_settings(tiny_dir: Path) -> None:
    text = heldout_text()
    key = verdict_key(tiny_dir, "int8", "auto", 1.0, text)
    assert key == verdict_key(tiny_dir, "int8", "auto", 1.0, text)
    others = {
        verdict_key(tiny_dir, "int4", "auto", 1.0, text),
        verdict_key(tiny_dir, "int8", "fp8", 1.0, text),
        verdict_key(tiny_dir, "int8", "auto", 2.0, text),
        verdict_key(tiny_dir, "int8", "auto", 1.0, text + "x"),
        verdict_key(tiny_dir, "int8", "auto", 1.0, text, 64),
    }
    assert key not in others and len(others) == 5
    weights = tiny_dir / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a new export
    assert verdict_key(tiny_dir, "int8", "auto", 1.0, text) != key
    assert verdict_file(tiny_dir) == tiny_dir / ".tidal-quant-gate.json"
    assert verdict_file(Path("/m/x.gguf")) == Path("/m/x.gguf.quant-gate.json")


def test_verdict_key_follows_the_kernel_sources(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed kernel gives other numbers: a verdict measured before it must not be reused."""
    text = heldout_text()
    sources = tmp_path / "kernels"
    shutil.copytree(build._SOURCES, sources)
    monkeypatch.setattr(build, "_SOURCES", sources)
    key = verdict_key(tiny_dir, "gguf-q8", "auto", 1.0, text)
    gemm = sources / "gguf_gemm.c"
    gemm.write_text(gemm.read_text() + "\n/* an edit */\n")
    assert verdict_key(tiny_dir, "gguf-q8", "auto", 1.0, text) != key


def test_quantize_check_measures_the_kv_cache(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", str(tiny_dir), "--max-tokens", "64"]
    assert gate_main([*base, "--kv-cache-dtype", "int8"]) == 0
    line = capsys.readouterr().out
    assert "PASS kv-int8: ppl " in line
    ppl_ref, ppl_quant, change_pct = _ppls(line)
    # Float: transformers' perplexity on the same 64 tokens (printed to 4 decimals). Quantized:
    # an 8-bit cache moves the scores (equal would mean the KV dtype was ignored), within 1%.
    assert ppl_ref == pytest.approx(_transformers_ppl(tiny_dir, 64), rel=1e-4)
    assert ppl_quant != ppl_ref and abs(change_pct) <= 1.0
    messages: list[str] = []  # a start with the same settings reuses quantize-check's verdict
    _build(tiny_dir, messages, kv_cache_dtype="int8")
    assert any(m.startswith("quantization gate (cached") for m in messages), messages
    assert gate_main([*base, "--quantization", "int8", "--kv-cache-dtype", "fp8"]) == 0
    assert "int8+kv-fp8" in capsys.readouterr().out
    with pytest.raises(ValueError, match="needs --quantization"):
        gate_main(base)


def test_serve_flags_reach_the_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in ("KV_CACHE_DTYPE", "QUANTIZATION_GATE", "FORCE_QUANTIZATION"):
        monkeypatch.setenv(f"TIDAL_MEMORY_{var}", "")  # restored (unset) after the test
        monkeypatch.delenv(f"TIDAL_MEMORY_{var}")
    args = ["serve", "--print-config", "--kv-cache-dtype", "fp8", "--no-quantization-gate"]
    assert tidal_main([*args, "--force-quantization"]) == 0
    memory = capsys.readouterr().out.split("memory:")[1]
    assert "kv_cache_dtype: fp8" in memory
    assert "quantization_gate: false" in memory and "force_quantization: true" in memory
    with pytest.raises(SystemExit):  # argparse: invalid choice
        tidal_main(["serve", "--print-config", "--kv-cache-dtype", "int4"])


def test_serve_int4_on_the_bundled_model_is_refused_with_exit_2(bundled_gguf: Path) -> None:
    """`tidal serve --quantization int4` at the default threshold (1%): the gate fails (int4 on the
    bundled Q4_K_M/Q5_0/Q6_K file moves perplexity by tens of percent), the server exits 2 with
    the gate's message, and the supervisor does not restart the engine: a failed gate is a setting
    to change, not a crash to retry."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        # The first 64 held-out tokens keep the gate's two passes short; the threshold stays the
        # default. The verdict is stored beside the model, so a later run reads it back.
        TIDAL_MEMORY_QUANTIZATION_GATE_MAX_TOKENS="64",
    )
    # No gate setting (threshold, force) or injected fault from the caller's environment.
    for key in [k for k in env if k.startswith(("TIDAL_MEMORY_", "TIDAL_MODEL_", "TIDAL_ENGINE"))]:
        if key != "TIDAL_MEMORY_QUANTIZATION_GATE_MAX_TOKENS":
            env.pop(key)
    cmd = [sys.executable, "-m", "tidal.cli_serve", "--host", "127.0.0.1", "--port", "0",
           "--model", str(bundled_gguf), "--quantization", "int4", "--kv-cache-bytes",
           str(16 << 20)]  # fmt: skip
    # A bound that turns a restart loop or a hang into a failure; nothing asserts the time taken.
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 2, log
    assert "refusing to serve int4: FAIL int4" in log and "limit +1.0%" in log, log
    assert log.count("starting (incarnation") == 1, log  # one engine process, never restarted
    assert "restarting the engine" not in log and "listening on" not in log, log
