"""The quantization table on a tiny model: every scheme gets a consistent row (never judged by size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine.tiny import make_tiny_model_dir
from tidal.bench.quant_table import main, parse_args


def test_table_has_a_consistent_row_per_scheme(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny")
    out_json, out_md = tmp_path / "q.json", tmp_path / "q.md"
    rc = main([
        "--model", str(model), "--schemes", "none,int8,int4,fp8", "--threads", "1",
        "--decode-batches", "1,4", "--decode-tokens", "4", "--prefill-len", "16",
        "--max-tokens", "80", "--json", str(out_json), "--markdown", str(out_md),
    ])  # fmt: skip
    assert rc == 0
    record = json.loads(out_json.read_text())
    rows = {r["scheme"]: r for r in record["rows"]}
    assert list(rows) == ["none", "int8", "int4", "fp8"]
    none = rows["none"]
    assert none["ppl_change_pct"] == 0.0 and none["top1_agreement"] == 1.0 and none["passes_gate"]
    for r in rows.values():
        assert r["ppl"] > 1.0 and 0.0 <= r["top1_agreement"] <= 1.0
        assert r["decode_x1"] > 0 and r["decode_x4"] > 0 and r["prefill_tok_s"] > 0
    # fewer bytes for every quantized scheme, int4 the fewest
    assert rows["int4"]["weight_bytes"] < rows["int8"]["weight_bytes"] < none["weight_bytes"]
    assert rows["fp8"]["weight_bytes"] < none["weight_bytes"]
    table = out_md.read_text().splitlines()
    assert len(table) == 2 + 4 and table[2].startswith("| none |")


def test_rejects_unknown_schemes() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--schemes", "int3"])
