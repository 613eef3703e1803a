"""HardwareConfig: the device, compute dtype, CPU threads, and the tensor- and data-parallel degrees to run on."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tidal.config._check import check
from tidal.config.model import DTYPES

EXECUTOR_BACKENDS = ("mp", "ray")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class HardwareConfig:
    # "auto" is cuda when a CUDA device is visible, else cpu (see `resolve_device`).
    device: str = "auto"
    # Compute (activation and KV cache) dtype; "auto" is resolved by the engine per device.
    dtype: str = "auto"
    # torch intra-op threads on CPU; None leaves torch's default.
    threads: int | None = None
    # Ranks one model is split across (tensor parallelism, tidal.executor): processes on CPU,
    # one per GPU on CUDA. It must divide the model's attention heads (checked at load).
    tensor_parallel: int = 1
    # Where ranks 1..N-1 live: "mp" (local processes) or "ray" (Ray actors, several machines).
    distributed_executor_backend: str = "mp"
    # A tensor-parallel collective that waits longer fails the group (a hung or unreachable
    # rank), which the supervisor then restarts whole.
    collective_timeout_s: float = 60.0
    # Engine replicas (each a supervised process holding the whole model) behind one API process
    # and its router (tidal/router/); CPU threads are split between them.
    data_parallel: int = 1

    def __post_init__(self) -> None:
        check(
            isinstance(self.device, str) and _DEVICE.fullmatch(self.device) is not None,
            "device",
            self.device,
            "auto, cpu, cuda or cuda:<index>",
        )
        check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        check(
            self.threads is None or self.threads >= 1,
            "threads",
            self.threads,
            "an integer >= 1 or None",
        )
        check(
            isinstance(self.data_parallel, int)
            and not isinstance(self.data_parallel, bool)
            and self.data_parallel >= 1,
            "data_parallel",
            self.data_parallel,
            "an integer >= 1",
        )
        check(
            isinstance(self.tensor_parallel, int)
            and not isinstance(self.tensor_parallel, bool)
            and self.tensor_parallel >= 1,
            "tensor_parallel",
            self.tensor_parallel,
            "an integer >= 1",
        )
        check(
            isinstance(self.collective_timeout_s, (int, float))
            and not isinstance(self.collective_timeout_s, bool)
            and self.collective_timeout_s > 0,
            "collective_timeout_s",
            self.collective_timeout_s,
            "a positive number of seconds",
        )
        check(
            self.distributed_executor_backend in EXECUTOR_BACKENDS,
            "distributed_executor_backend",
            self.distributed_executor_backend,
            f"one of {', '.join(EXECUTOR_BACKENDS)}",
        )

    def resolve_device(self, cuda_available: bool) -> str:
        """The concrete device; the caller says whether CUDA is usable so config never imports torch."""
        if self.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.device
