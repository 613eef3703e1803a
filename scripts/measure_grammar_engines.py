"""Compile time and per-token mask time of the grammar engines on the bundled model's tokenizer.

Usage: python scripts/measure_grammar_engines.py [--engines llguidance,outlines-core,xgrammar]

For one JSON schema it compiles the grammar (timed, first compile and a second one), then walks a
schema-valid JSON document token by token (the bundled tokenizer's own encoding of it) and times
the mask each step needs: the bitmask of allowed ids over the 262,144-token vocabulary, then
advancing the matcher by the next token. Prints one line per engine and a JSON record.
xgrammar is measured only when it imports (it is not a tidal dependency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
        },
        "status": {"enum": ["active", "inactive", "banned"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "status"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "12345"},
    "status": "active",
    "score": 99.5,
}


def _tokenizer():
    from tidal.loader.bundled import bundled_model_path
    from tidal.loader.tokenizer import load_tokenizer

    return load_tokenizer(bundled_model_path())


def _summary(name: str, compile_s: list[float], mask_s: list[float], vocab: int) -> dict:
    record = {
        "engine": name,
        "vocab_size": vocab,
        "compile_first_ms": round(compile_s[0] * 1e3, 1),
        "compile_again_ms": round(compile_s[1] * 1e3, 1),
        "tokens": len(mask_s),
        "mask_mean_us": round(statistics.mean(mask_s) * 1e6, 1),
        "mask_p50_us": round(statistics.median(mask_s) * 1e6, 1),
        "mask_p99_us": round(sorted(mask_s)[int(0.99 * (len(mask_s) - 1))] * 1e6, 1),
        "mask_max_us": round(max(mask_s) * 1e6, 1),
    }
    print(
        f"{name:14s} compile {record['compile_first_ms']:9.1f} ms (again "
        f"{record['compile_again_ms']:.1f} ms)  mask mean {record['mask_mean_us']:8.1f} us  "
        f"p50 {record['mask_p50_us']:8.1f} us  p99 {record['mask_p99_us']:8.1f} us over "
        f"{record['tokens']} tokens"
    )
    return record


def measure_llguidance(tok, text: str) -> dict:
    import llguidance
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(
        tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids)
    )
    print(f"llguidance tokenizer wrap: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    compile_s = []
    for _ in range(2):
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        matcher.is_accepting()
        compile_s.append(time.perf_counter() - t0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False)
    mask = lltorch.allocate_token_bitmask(1, tok.vocab_size)
    mask_s = []
    for token in ids:
        t0 = time.perf_counter()
        lltorch.fill_next_token_bitmask(matcher, mask, 0)
        mask_s.append(time.perf_counter() - t0)
        allowed = (int(mask[0, token // 32]) >> (token % 32)) & 1
        assert allowed, f"token {token} ({tok.decode([token])!r}) masked out"
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_accepting()
    return _summary("llguidance", compile_s, mask_s, tok.vocab_size)


def measure_outlines_core(tok, text: str) -> dict:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # Gemma's SentencePiece pieces: "▁" is a space, "<0xNN>" one byte; specials are left out.
    eos = min(tok.eos_token_ids)
    pieces: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i in tok.all_special_ids or i in tok.eos_token_ids:
            continue
        piece = tok.hf.id_to_token(i)
        if piece is None:
            continue
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            raw = bytes([int(piece[3:5], 16)])
        else:
            raw = piece.replace("\u2581", " ").encode()
        pieces.setdefault(raw, []).append(i)
    vocab = Vocabulary(eos, pieces)
    regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
    compile_s = []
    for _ in range(2):
        t0 = time.perf_counter()
        index = Index(regex, vocab)
        compile_s.append(time.perf_counter() - t0)
    guide = Guide(index)
    ids = tok.encode(text, add_special_tokens=False)
    mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)
    mask_s = []
    for token in ids:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        mask_s.append(time.perf_counter() - t0)
        guide.advance(token)
    return _summary("outlines-core", compile_s, mask_s, tok.vocab_size)


def measure_xgrammar(tok, text: str) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    encoded = [tok.hf.id_to_token(i) or "" for i in range(tok.vocab_size)]
    tinfo = xgr.TokenizerInfo(
        encoded, xgr.VocabType.BYTE_FALLBACK, stop_token_ids=sorted(tok.eos_token_ids)
    )
    print(f"xgrammar tokenizer info: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    compile_s = []
    for _ in range(2):
        compiler = xgr.GrammarCompiler(tinfo, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
        compile_s.append(time.perf_counter() - t0)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    ids = tok.encode(text, add_special_tokens=False)
    mask_s = []
    for token in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        mask_s.append(time.perf_counter() - t0)
        assert matcher.accept_token(token), f"token {token} ({tok.decode([token])!r}) refused"
    del torch
    return _summary("xgrammar", compile_s, mask_s, tok.vocab_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="llguidance,outlines-core,xgrammar")
    args = ap.parse_args()
    tok = _tokenizer()
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    runs = {
        "llguidance": measure_llguidance,
        "outlines-core": measure_outlines_core,
        "xgrammar": measure_xgrammar,
    }
    records = []
    for name in args.engines.split(","):
        try:
            records.append(runs[name](tok, text))
        except ImportError as e:
            print(f"{name:14s} not measured: {e}")
    print(json.dumps(records))


if __name__ == "__main__":
    main()
