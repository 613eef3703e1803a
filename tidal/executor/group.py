"""RankGroup: rank 0's side of a tensor-parallel group, and the executor the EngineCore steps.

Rank 0 (the engine process) runs the scheduler and the sampler; for each step it broadcasts the
StepInputs (one int64 tensor, tidal.executor.step_message) and every rank runs its shard of the
model; the logits are all-gathered and only rank 0 samples (the others drop them). Any rank
lost (it exited, or a collective raised or timed out) loses the group: `GroupLost` is raised at
the next step and `on_lost` is called at once (the engine process exits there, so the
supervisor restarts the whole group). Subclasses say where ranks 1..N-1 live (mp.py: local
processes; ray_group.py: Ray actors).
"""

from __future__ import annotations

import atexit
import logging
import socket
from collections.abc import Callable

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


class RankGroup:
    """Rank 0 of a started group. Subclasses start ranks 1..N-1, then call `_join()`."""

    def __init__(self, spec: RankSpec, on_lost: Callable[[str], None] | None) -> None:
        assert spec.rank == 0
        self.spec = spec
        self.on_lost = on_lost
        self.lost: str | None = None
        self._closing = False

    def _join(self) -> None:
        self.groups = join_group(self.spec)
        atexit.register(self.shutdown)

    def _lose(self, reason: str) -> None:
        if self.lost is None and not self._closing:
            self.lost = reason
            log.error("%s: the group is lost", reason)
            if self.on_lost is not None:
                self.on_lost(reason)

    def load(self) -> LoadedModel:
        """Rank 0's own shard (the other ranks load theirs at the same time)."""
        return load_rank(self.spec, self.groups)

    def executor(
        self, loaded: LoadedModel, layout: KVLayout, num_blocks: int, kv_dtype: torch.dtype
    ) -> TensorParallelExecutor:
        """The step executor over the group; the other ranks size their KV pools as rank 0's."""
        sizing = [(layout, num_blocks, str(kv_dtype).removeprefix("torch."))]
        dist.broadcast_object_list(sizing, src=0, group=self.groups.control)
        return TensorParallelExecutor(self, ModelRunner(loaded, layout, num_blocks, kv_dtype))

    def send_step(self, inputs: StepInputs) -> None:
        msg = pack_step(inputs)
        dist.broadcast(torch.tensor([STEP, msg.numel()]), src=0, group=self.groups.control)
        dist.broadcast(msg, src=0, group=payload_group(self.groups, self.spec))

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group (idempotent)."""
        if self._closing:
            return
        self._closing = True
        if self.lost is None and hasattr(self, "groups"):
            try:
                dist.broadcast(torch.tensor([STOP, 0]), src=0, group=self.groups.control)
            except RuntimeError:
                pass
        self._stop_ranks()
        leave_group()

    def _stop_ranks(self) -> None:
        raise NotImplementedError


class TensorParallelExecutor:
    """The EngineCore's step runner over a RankGroup (ModelRunner's interface)."""

    def __init__(self, group: RankGroup, runner: ModelRunner) -> None:
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

    @property
    def grammars(self):  # the engine hands rank 0's runner its grammar matchers (rank 0 samples)
        return self.runner.grammars

    @grammars.setter
    def grammars(self, value) -> None:
        self.runner.grammars = value

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def shutdown(self) -> None:
        self.group.shutdown()
