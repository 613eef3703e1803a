"""ChildProcess, what engine and standby processes run in: a target with its pipe, exit codes and
signals as multiprocessing reports them, the parent's import path, no resource tracker, and no
child left running after the parent exits. Real processes throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

import psutil
import pytest

from tidal.supervisor.child_process import ChildProcess


def echo_then_exit(conn: Connection, code: int) -> None:
    conn.send(("pid", os.getpid(), conn.recv()))
    sys.exit(code)


def wait_forever(conn: Connection) -> None:
    conn.send("up")
    time.sleep(600)


def _dead_within(child: ChildProcess, seconds: float) -> None:
    assert wait([child.sentinel], timeout=seconds), "the sentinel did not report the exit"
    child.join(timeout=seconds)
    assert not child.is_alive()


def test_the_target_talks_over_its_pipe_and_its_exit_code_comes_back() -> None:
    child = ChildProcess(echo_then_exit, {"code": 3})
    child.conn.send("hello")
    assert child.conn.recv() == ("pid", child.pid, "hello")
    _dead_within(child, 30)
    assert child.exitcode == 3
    with pytest.raises(EOFError):  # the child held the pipe's only other end
        child.conn.recv()


def test_a_killed_child_reports_the_signal() -> None:
    child = ChildProcess(wait_forever, {})
    assert child.conn.recv() == "up"
    assert child.is_alive() and child.exitcode is None
    child.kill()
    _dead_within(child, 30)
    assert child.exitcode == -signal.SIGKILL


def test_the_child_imports_from_the_parents_path_and_starts_no_tracker(tmp_path: Path) -> None:
    """A target in a module only the parent's sys.path finds (as a test's or an embedding
    application's can be); multiprocessing's spawn would also have started its resource
    tracker, a second child of this process."""
    (tmp_path / "only_here.py").write_text("def answer(conn, value):\n    conn.send(value * 2)\n")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import psutil
        import only_here
        from tidal.supervisor.child_process import ChildProcess

        child = ChildProcess(only_here.answer, {{"value": 21}})
        print(child.conn.recv())
        child.join(timeout=30)
        print(child.exitcode, len(psutil.Process().children()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["42", "0", "0"]


def test_a_child_still_running_when_the_parent_exits_is_killed() -> None:
    """As multiprocessing killed its daemonic children, even one whose handle is gone."""
    script = textwrap.dedent(
        """
        from tests.faults.test_child_process import wait_forever
        from tidal.supervisor.child_process import ChildProcess

        child = ChildProcess(wait_forever, {})
        assert child.conn.recv() == "up"
        print(child.pid, flush=True)
        del child  # a dropped handle: the child is still this process's to kill at exit
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"child {pid} outlived its parent"
        time.sleep(0.1)
