"""`tidal bench compare --target-tpot-ms`: the TPOT-target run joins the target list beside tidal."""

from __future__ import annotations

import pytest

from tidal.bench.compare import (
    TARGETS,
    TPOT_TARGET,
    ServerHandle,
    context_tokens,
    target_list,
    tidal_command,
)
from tidal.cli import build_parser


def test_target_tpot_ms_adds_a_tidal_run_after_tidal() -> None:
    names, targets = target_list("llama.cpp,tidal,hf-static", 150.0)
    assert names == ["llama.cpp", "tidal", TPOT_TARGET, "hf-static"]
    t = targets[TPOT_TARGET]
    assert t.kind == "tidal" and t.args == ("--target-tpot-ms", "150")
    names, targets = target_list("tidal", None)
    assert names == ["tidal"] and TPOT_TARGET not in targets


def test_tpot_target_needs_the_flag_and_a_positive_value() -> None:
    with pytest.raises(ValueError, match="needs --target-tpot-ms"):
        target_list(f"tidal,{TPOT_TARGET}", None)
    with pytest.raises(ValueError, match=r"^--target-tpot-ms=0.0 is invalid"):
        target_list("tidal", 0.0)
    with pytest.raises(ValueError, match=r"targets=\['nope'\] is invalid"):
        target_list("nope", None)


def test_the_flag_parses() -> None:
    args = build_parser().parse_args(
        ["bench", "compare", "--target-tpot-ms", "150", "--workload", "mix"]
    )
    assert args.target_tpot_ms == 150.0


def test_tidal_holds_the_context_llama_server_is_given() -> None:
    """Memory is compared at equal KV tokens over equal sequences: llama-server's -c is tidal's
    --kv-cache-tokens, its --parallel slots tidal's --max-num-seqs."""
    args = build_parser().parse_args(["bench", "compare", "--parallel", "12"])
    assert context_tokens(args) == 4096 * 12
    cmd = tidal_command(TARGETS["tidal"], None, args)
    assert cmd[cmd.index("--kv-cache-tokens") + 1] == str(4096 * 12)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "12"
    cmd = tidal_command(TARGETS["tidal-max-num-seqs-1"], None, args)
    assert cmd.count("--max-num-seqs") == 1 and cmd[-2:] == ["--max-num-seqs", "1"]
    args = build_parser().parse_args(["bench", "compare", "--context-tokens", "8192"])
    cmd = tidal_command(TARGETS["tidal-int8"], None, args)
    assert cmd[cmd.index("--kv-cache-tokens") + 1] == "8192"
    assert cmd[-3:] == list(TARGETS["tidal-int8"].args)


def test_the_data_parallel_target_runs_two_replicas() -> None:
    names, targets = target_list("tidal,tidal-dp2", None)
    assert names == ["tidal", "tidal-dp2"]
    t = targets["tidal-dp2"]
    assert t.kind == "tidal" and t.args == ("--data-parallel", "2")


def test_a_server_killed_by_sigill_while_loading_says_why(tmp_path) -> None:
    # a real process that dies as a natively built llama-server does on a CPU with AMX tiles
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho loading\nsleep 0.2\nkill -ILL $$\n")
    server.chmod(0o755)
    handle = ServerHandle([str(server)], tmp_path / "s.log", "http://127.0.0.1:9", llama_cpp=True)
    try:
        with pytest.raises(RuntimeError, match=r"^server was killed by SIGILL \(an illegal"):
            handle.wait_ready("/health", 30.0)
    finally:
        handle.stop()
    assert "loading" in (tmp_path / "s.log").read_text()
    # another server (tidal's) killed so gets the signal's name, not llama.cpp's remedy
    handle = ServerHandle([str(server)], tmp_path / "t.log", "http://127.0.0.1:9")
    try:
        with pytest.raises(RuntimeError, match=r"^server was killed by SIGILL; see "):
            handle.wait_ready("/health", 30.0)
    finally:
        handle.stop()
