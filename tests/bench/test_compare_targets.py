"""`tidal bench compare`: the TPOT-target run joins the target list beside tidal; the llama.cpp and
ik_llama.cpp targets' commands and exit statuses."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tidal.bench.baselines import IK_LLAMA_CPP, LLAMA_CPP
from tidal.bench.compare import (
    TARGETS,
    TPOT_TARGET,
    ServerHandle,
    context_tokens,
    llama_server_command,
    start_target,
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
    handle = ServerHandle([str(server)], tmp_path / "s.log", "http://127.0.0.1:9", LLAMA_CPP)
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


def test_a_server_that_logs_bytes_outside_utf8_is_still_found_and_logged(tmp_path) -> None:
    # a real process printing a cut multi-byte character (a half token), then its address
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\nprintf 'token \\342\\202 cut\\n'\n"
                      "echo 'main: server is listening on http://127.0.0.1:9'\n"
                      "echo after\nsleep 30\n")  # fmt: skip
    server.chmod(0o755)
    handle = ServerHandle([str(server)], tmp_path / "s.log")
    try:
        assert handle._found.wait(30.0) and handle.base_url == "http://127.0.0.1:9"
        deadline = time.monotonic() + 30.0
        while "after" not in (tmp_path / "s.log").read_text():
            assert time.monotonic() < deadline, "the pump stopped at the bad bytes"
            time.sleep(0.05)
    finally:
        handle.stop()
    assert "token \ufffd" in (tmp_path / "s.log").read_text()


def test_ik_server_runs_as_llama_servers_with_run_time_repacking() -> None:
    """The same slots, context, threads and flags as llama.cpp's target, then ik's -rtr (a flag
    in its server, unlike its llama-bench's `-rtr 1`)."""
    names, targets = target_list("tidal,llama.cpp,ik_llama.cpp", None)
    assert names == ["tidal", "llama.cpp", "ik_llama.cpp"]
    assert targets["ik_llama.cpp"].kind == "ik_llama.cpp" and "ik_llama.cpp" in TARGETS
    args = build_parser().parse_args(["bench", "compare", "--parallel", "4", "--threads", "2"])
    llama = llama_server_command("/l/llama-server", LLAMA_CPP, Path("m.gguf"), 8080, args)
    ik = llama_server_command("/ik/llama-server", IK_LLAMA_CPP, Path("m.gguf"), 8080, args)
    assert ik == ["/ik/llama-server", *llama[1:], "-rtr"]
    no_fa = TARGETS["ik_llama.cpp-no-fa"]
    assert no_fa.kind == "ik_llama.cpp" and no_fa.args == ("-fa", "off")
    assert llama[llama.index("-c") + 1] == str(4096 * 4) and "--cont-batching" in llama
    assert llama[llama.index("--parallel") + 1] == "4" and llama[llama.index("-t") + 1] == "2"


def test_an_unbuilt_ik_server_is_skipped_with_its_build_script(tmp_path, monkeypatch) -> None:
    """llama.cpp's llama-server on PATH does not stand in for ik_llama.cpp's."""
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "llama-server").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("IK_LLAMA_SERVER", raising=False)
    args = build_parser().parse_args(["bench", "compare"])
    with pytest.raises(FileNotFoundError, match=r"ik_llama.cpp/bin/llama-server is not built: run "
                       r"scripts/build_ik_llama.sh"):  # fmt: skip
        start_target(TARGETS["ik_llama.cpp"], tmp_path / "m.gguf", args, tmp_path)


def test_an_ik_server_starts_from_its_bin_dir_and_says_how_it_was_built(
    tmp_path, monkeypatch
) -> None:
    bin_dir = tmp_path / "ik" / "bin"
    bin_dir.mkdir(parents=True)
    server = bin_dir / "llama-server"
    server.write_text("#!/bin/sh\necho log > llama.log\nkill -ILL $$\n")  # as ik's: ./llama.log
    server.chmod(0o755)
    (bin_dir / "FLAVOR").write_text("native\n")
    (bin_dir / "COMMIT").write_text("8337e4cd\n")
    monkeypatch.setenv("IK_LLAMA_SERVER", str(server))
    args = build_parser().parse_args(["bench", "compare"])
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    handle, ready = start_target(TARGETS["ik_llama.cpp"], Path("m.gguf"), args, log_dir)
    try:
        assert ready == "/health" and handle.baseline is IK_LLAMA_CPP
        assert handle.cmd[0] == str(server) and handle.cmd[-1] == "-rtr"
        assert handle.cmd[handle.cmd.index("-m") + 1] == str(tmp_path / "m.gguf")
        with pytest.raises(RuntimeError, match=r"^server was killed by SIGILL \(an illegal "
                           r"instruction: ik_llama.cpp is built for the CPU it was built on"):  # fmt: skip
            handle.wait_ready(ready, 30.0)
    finally:
        handle.stop()
    assert (log_dir / "llama.log").exists() and not (tmp_path / "llama.log").exists()
    assert IK_LLAMA_CPP.built(bin_dir) == "native from 8337e4cd"
    (bin_dir / "FLAVOR").unlink()
    assert IK_LLAMA_CPP.built(bin_dir) == "from 8337e4cd"
    assert LLAMA_CPP.built(bin_dir) is None  # no SDIST, no FLAVOR
