"""LocalProcessGroup: ranks 1..N-1 as local processes (`python -m tidal.executor.worker`)."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace

from tidal.executor.group import RankGroup, free_port
from tidal.executor.rank import RankSpec

log = logging.getLogger(__name__)


class LocalProcessGroup(RankGroup):
    """Starts each worker rank with its RankSpec on stdin and watches it; a worker that exits
    loses the group. Workers end with this process (PR_SET_PDEATHSIG, tidal.executor.worker)."""

    def __init__(self, spec: RankSpec, on_lost: Callable[[str], None] | None = None) -> None:
        if spec.master_port == 0:
            spec = replace(spec, master_port=free_port(spec.master_addr))
        spec = replace(
            spec, die_with_parent_thread=threading.current_thread() is threading.main_thread()
        )
        super().__init__(spec, on_lost)
        self.workers: list[subprocess.Popen] = []
        for rank in range(1, spec.world_size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "tidal.executor.worker"], stdin=subprocess.PIPE
            )
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec.for_rank(rank)))
            proc.stdin.close()
            self.workers.append(proc)
            log.info("tensor-parallel rank %d/%d started: pid %d", rank, spec.world_size, proc.pid)
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tidal-rank-{rank}", daemon=True
            ).start()
        try:
            self._join()
        except BaseException:
            self._stop_ranks()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self._lose(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def _stop_ranks(self) -> None:
        self._closing = True
        for proc in self.workers:
            if self.lost is not None:  # a lost group's ranks may be stuck: no point waiting
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
