"""RankSpec and the start of one tensor-parallel rank: join the group, load and wrap its shard.

Every rank (the engine process is rank 0) runs `join_group` then `load_rank`; the settings come
resolved from the engine's builder, so a rank never re-reads the EngineConfig's "auto"s.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal.loader.model_loader import LoadedModel

log = logging.getLogger(__name__)

# A collective that waits longer than this (hardware.collective_timeout_s) raises on the ranks
# still in it: a rank that hangs mid-step cannot hang the group forever (rank 0 then exits and
# the supervisor restarts all).
COLLECTIVE_TIMEOUT_S = 60.0
# How long rank 0 waits for every rank to join the group.
START_TIMEOUT_S = 600.0
# Workers wait for the next step on a separate group with no practical limit (an idle server).
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank needs to start, all resolved (a small picklable message)."""

    path: str  # the checkpoint
    dtype: str  # torch dtype name, e.g. "float32"
    device: str  # "cpu" or "cuda" (rank r uses cuda:r)
    scheme: str  # resolved model.quantization
    rank: int
    world_size: int
    master_port: int  # rank 0's TCP rendezvous on master_addr
    master_addr: str = "127.0.0.1"
    threads: int = 1  # torch (and kernel) threads of this rank
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    # End a local worker when the thread that started it ends (PR_SET_PDEATHSIG); only set when
    # that thread is the main thread, which lives as long as the process.
    die_with_parent_thread: bool = False
    huge_pages: bool = True  # model.huge_pages: a GGUF's largest matrices in huge pages

    def for_rank(self, rank: int) -> RankSpec:
        from dataclasses import replace

        return replace(self, rank=rank)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", self.rank)
        return torch.device(self.device)


@dataclass(slots=True)
class Groups:
    """The step's collectives (a timeout) and the idle wait for the next step (none)."""

    compute: dist.ProcessGroup
    control: dist.ProcessGroup


def threads_per_rank(total: int | None, world_size: int) -> int:
    """Each rank's share of `total` threads (hardware.threads; None: the machine's CPUs)."""
    cpus = total if total is not None else (os.cpu_count() or 1)
    return max(1, cpus // world_size)


def join_group(spec: RankSpec) -> Groups:
    torch.set_num_threads(spec.threads)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    if spec.device == "cuda":
        torch.cuda.set_device(spec.rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
        rank=spec.rank,
        world_size=spec.world_size,
        # Ranks start at their own pace (importing torch, loading): the rendezvous waits long.
        timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
    )
    compute = dist.new_group(
        backend=backend, timeout=datetime.timedelta(seconds=spec.collective_timeout_s)
    )
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    return Groups(compute, control)


def load_rank(spec: RankSpec, groups: Groups) -> LoadedModel:
    """This rank's shard, quantized as the scheme says, wrapped for the group."""
    from tidal.config.quant import NATIVE_SCHEMES
    from tidal.layers.parallel import parallelize
    from tidal.loader.model_loader import load_model
    from tidal.quant.registry import quantize_model

    loaded = load_model(
        spec.path,
        getattr(torch, spec.dtype),
        spec.torch_device,
        weight_cache=False,
        gguf_blocks=spec.scheme in NATIVE_SCHEMES,
        tensor_parallel=(spec.rank, spec.world_size),
        huge_pages=spec.huge_pages,
    )
    if spec.scheme not in ("none", "gguf"):
        quantize_model(loaded.model, spec.scheme)
    assert loaded.shard is not None
    parallelize(loaded.model, loaded.shard, groups.compute)
    log.info(
        "rank %d/%d loaded its shard in %.2f s", spec.rank, spec.world_size, loaded.load_time_s
    )
    return loaded


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
