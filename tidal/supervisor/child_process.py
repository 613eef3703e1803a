"""ChildProcess: run a top-level function in a fresh Python process, connected by one pipe.

The engine and standby processes used to be multiprocessing "spawn" processes. Spawning starts a
second helper process beside them, multiprocessing's resource tracker (~13 MiB RSS for the
server's life, to clean up named semaphores and shared memory tidal never creates), and each
child imports the parent's main module again (`tidal serve`'s CLI) before its target runs.
Here the child is `python -m tidal.supervisor.child_process FD` (with the parent's interpreter
flags): it inherits one end of a socket pair (a multiprocessing Connection, so messages are
pickled as before), takes the parent's sys.path from it, then the target and its keyword
arguments; the target gets the connection as `conn`.

The parent end is the only other end: when the child dies, the parent's `conn.recv()` raises
EOFError at once, and a pidfd (Linux) makes the death waitable as multiprocessing's sentinel
was. Children still running when the parent exits are killed, as multiprocessing did for its
daemonic children.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe
from typing import Any

# Every child not yet seen to exit, held here (not by its ChildProcess alone) so that one whose
# handle was dropped is still killed when this process exits.
_LIVE: set[subprocess.Popen[bytes]] = set()


class ChildProcess:
    """`target(conn=<its end of the pipe>, **kwargs)` in a new Python process.

    The surface EngineHandle uses from multiprocessing.Process: pid, is_alive, exitcode
    (negative: killed by that signal), join, kill, sentinel; plus `conn`, the parent's end."""

    def __init__(self, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self._pidfd: int | None = None
        self.conn, child = Pipe(duplex=True)
        try:
            fd = child.fileno()
            flags = getattr(subprocess, "_args_from_interpreter_flags", list)()  # -B, -X, ...
            self._popen = subprocess.Popen(
                [sys.executable, *flags, "-m", "tidal.supervisor.child_process", str(fd)],
                pass_fds=(fd,),
                close_fds=True,
            )
        finally:
            child.close()  # only the child holds its end: its death closes the pipe
        self.pid = self._popen.pid
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or a kernel before 5.3
            self._pidfd = os.pidfd_open(self.pid)
        _LIVE.add(self._popen)
        # A child that died at once shows as dead to is_alive() and the pipe's reader.
        with contextlib.suppress(OSError):
            self.conn.send(list(sys.path))  # before the target: unpickling it imports its module
            self.conn.send((target, kwargs))

    @property
    def sentinel(self) -> Connection | int:
        """Ready for multiprocessing.connection.wait() once the process has exited (its pidfd;
        without one the pipe, which the death closes)."""
        return self.conn if self._pidfd is None else self._pidfd

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)
        if self._popen.returncode is not None:
            _LIVE.discard(self._popen)
            self._close_pidfd()

    def kill(self) -> None:
        if self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.kill()

    def _close_pidfd(self) -> None:
        fd, self._pidfd = getattr(self, "_pidfd", None), None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self._close_pidfd()


@atexit.register
def _kill_children() -> None:
    for popen in list(_LIVE):
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(10)


def _main() -> None:
    conn = Connection(int(sys.argv[1]))
    sys.path[:] = conn.recv()
    target, kwargs = conn.recv()
    target(conn=conn, **kwargs)


if __name__ == "__main__":
    _main()
