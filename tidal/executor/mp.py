"""TensorParallelGroup: rank 0 (the engine process) and its worker ranks as local processes.

Rank 0 runs the scheduler and the sampler; for each step it broadcasts the StepInputs (one int64
tensor, tidal.executor.step_message) and every rank runs its shard of the model; the logits are
all-gathered, and only rank 0 samples. Any rank lost (it exited, or a collective raised or timed
out) loses the group: `GroupLost` is raised at the next step, and `on_lost` is called at once
(the engine process exits there, so the supervisor restarts the whole group).
"""

from __future__ import annotations

import atexit
import logging
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from tidal.executor.errors import GroupLost
from tidal.executor.rank import RankSpec, join_group, leave_group, load_rank
from tidal.executor.step_message import pack_step
from tidal.executor.worker import STEP, STOP, payload_group
from tidal.kv.layout import KVLayout
from tidal.loader.model_loader import LoadedModel
from tidal.scheduler.output import SchedulerOutput
from tidal.worker.model_runner import ModelRunner, RunnerOutput, StepInputs

log = logging.getLogger(__name__)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """Starts ranks 1..N-1 as `python -m tidal.executor.worker` and joins them as rank 0."""

    def __init__(self, spec: RankSpec, on_lost: Callable[[str], None] | None = None) -> None:
        assert spec.rank == 0
        if spec.master_port == 0:
            spec = replace(spec, master_port=free_port(spec.master_addr))
        self.spec = spec
        self.on_lost = on_lost
        self.lost: str | None = None
        self._closing = False
        self.workers: list[subprocess.Popen] = []
        for rank in range(1, spec.world_size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "tidal.executor.worker"], stdin=subprocess.PIPE
            )
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec.for_rank(rank)))
            proc.stdin.close()
            self.workers.append(proc)
        for rank, proc in enumerate(self.workers, start=1):
            log.info("tensor-parallel rank %d/%d started: pid %d", rank, spec.world_size, proc.pid)
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tidal-rank-{rank}", daemon=True
            ).start()
        self.groups = join_group(spec)
        atexit.register(self.shutdown)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._closing:
            return
        self._lose(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            log.error("%s: the group is lost", reason)
            if self.on_lost is not None:
                self.on_lost(reason)

    def load(self) -> LoadedModel:
        """Rank 0's own shard (the workers load theirs at the same time)."""
        return load_rank(self.spec, self.groups)

    def executor(
        self, loaded: LoadedModel, layout: KVLayout, num_blocks: int, kv_dtype: torch.dtype
    ) -> TensorParallelExecutor:
        """The step executor over the group; the workers size their KV pools as rank 0's."""
        sizing = [(layout, num_blocks, str(kv_dtype).removeprefix("torch."))]
        dist.broadcast_object_list(sizing, src=0, group=self.groups.control)
        return TensorParallelExecutor(self, ModelRunner(loaded, layout, num_blocks, kv_dtype))

    def send_step(self, inputs: StepInputs) -> None:
        msg = pack_step(inputs)
        dist.broadcast(torch.tensor([STEP, msg.numel()]), src=0, group=self.groups.control)
        dist.broadcast(msg, src=0, group=payload_group(self.groups, self.spec))

    def shutdown(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self._closing:
            return
        self._closing = True
        if self.lost is None:
            try:
                dist.broadcast(torch.tensor([STOP, 0]), src=0, group=self.groups.control)
            except RuntimeError:
                pass
        for proc in self.workers:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        leave_group()


class TensorParallelExecutor:
    """The EngineCore's step runner over a TensorParallelGroup (ModelRunner's interface)."""

    def __init__(self, group: TensorParallelGroup, runner: ModelRunner) -> None:
        self.group = group
        self.runner = runner
        self.model = runner.model

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if self.group.lost is not None:
            raise GroupLost(self.group.lost)
        if sched.is_empty:
            return RunnerOutput()
        try:
            return self.runner.execute(sched, on_inputs=self.group.send_step)
        except Exception as e:
            # NOTE: the other ranks were sent this step and are in (or past) its collectives:
            # whatever failed here (a peer died, a collective timed out), lockstep is gone.
            self.group._lose(f"a step failed on rank 0 ({type(e).__name__}: {e})")
            raise GroupLost(self.group.lost or str(e)) from e

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def shutdown(self) -> None:
        self.group.shutdown()
