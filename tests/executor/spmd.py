"""run_ranks: call one function on every rank of a gloo group of local processes (127.0.0.1)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
from collections.abc import Callable
from typing import Any

TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world: int, port: int, args: tuple, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        # Plain pickle bytes: the queue's own pickler would share tensors through file
        # descriptors that close when this process exits.
        results.put((rank, pickle.dumps(fn(rank, world, *args))))
    except BaseException as e:  # the parent re-raises it with the rank's traceback text
        import traceback

        results.put((rank, RuntimeError(f"rank {rank}: {e!r}\n{traceback.format_exc()}")))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on each rank (a spawned process); their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=TIMEOUT_S) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in range(world_size):
        if isinstance(got[r], BaseException):
            raise got[r]
    return [pickle.loads(got[r]) for r in range(world_size)]
