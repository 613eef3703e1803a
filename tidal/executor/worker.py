"""A tensor-parallel worker rank (`python -m tidal.executor.worker`, its RankSpec pickled on
stdin): load the shard, then run every step rank 0 broadcasts until told to stop."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from tidal.executor.rank import Groups, RankSpec, join_group, leave_group, load_rank
from tidal.executor.step_message import unpack_step

log = logging.getLogger("tidal.executor.worker")

STEP, STOP = 1, 2
# Fault injection (tests only, off by default): "hang_on_step=N" blocks a worker rank forever
# once it has received its N-th step, as a rank stuck mid-collective would.
FAULT_ENV = "TIDAL_RANK_FAULT"


def payload_group(groups: Groups, spec: RankSpec) -> dist.ProcessGroup:
    """The group a step's inputs travel on: the compute group (its timeout) where it is gloo;
    NCCL groups carry CUDA tensors only, so on CUDA the CPU message takes the gloo group."""
    return groups.control if spec.device == "cuda" else groups.compute


def hang_step(spec: str | None) -> int | None:
    """The step a worker hangs at under TIDAL_RANK_FAULT="hang_on_step=N" (tests only)."""
    if not spec:
        return None
    name, _, arg = spec.partition("=")
    if name != "hang_on_step" or not arg.isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r} is invalid: expected 'hang_on_step=<N>'")
    return int(arg)


def serve_steps(runner, groups: Groups, spec: RankSpec) -> None:
    """Run rank 0's steps until STOP. `runner` is this rank's tidal.worker.ModelRunner."""
    header = torch.zeros(2, dtype=torch.long)  # (kind, payload length)
    ship = payload_group(groups, spec)
    hang_at = hang_step(os.environ.get(FAULT_ENV))
    steps = 0
    while True:
        dist.broadcast(header, src=0, group=groups.control)
        kind, length = header.tolist()
        if kind == STOP:
            return
        msg = torch.empty(length, dtype=torch.long)
        dist.broadcast(msg, src=0, group=ship)
        steps += 1
        if steps == hang_at:
            log.warning("fault injection: this rank hangs at step %d", steps)
            threading.Event().wait()
        runner.forward(unpack_step(msg))


def _die_with_parent(parent_pid: int, signal_too: bool) -> None:
    """The engine process (rank 0) owns this rank: end with it, even when it is SIGKILLed."""
    if signal_too:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:  # where prctl is missing, and for a parent gone before prctl ran
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tidal-rank-parent", daemon=True).start()


def main() -> None:
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    _die_with_parent(os.getppid(), spec.die_with_parent_thread)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: %(message)s",
    )
    from tidal.worker.model_runner import ModelRunner

    groups = join_group(spec)
    loaded = load_rank(spec, groups)
    sizing: list = [None]
    dist.broadcast_object_list(sizing, src=0, group=groups.control)  # rank 0's KV sizing
    layout, num_blocks, kv_dtype = sizing[0]
    runner = ModelRunner(loaded, layout, num_blocks, getattr(torch, kv_dtype))
    try:
        serve_steps(runner, groups, spec)
    finally:
        leave_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        log.exception("tensor-parallel rank failed")
        sys.exit(1)
