"""HardwareConfig: the device, compute dtype, CPU threads, and the tensor- and data-parallel degrees to run on."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tidal.config._check import check
from tidal.config.model import DTYPES

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class HardwareConfig:
    # "auto" is cuda when a CUDA device is visible, else cpu (see `resolve_device`).
    device: str = "auto"
    # Compute (activation and KV cache) dtype; "auto" is resolved by the engine per device.
    dtype: str = "auto"
    # torch intra-op threads on CPU; None leaves torch's default.
    threads: int | None = None
    # Devices one model is split across. Only 1 runs today: tensor parallelism is not built yet,
    # so a larger value is refused rather than silently served from one device.
    tensor_parallel: int = 1
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
            isinstance(self.data_parallel, int) and self.data_parallel >= 1,
            "data_parallel",
            self.data_parallel,
            "an integer >= 1",
        )
        check(
            self.tensor_parallel == 1,
            "tensor_parallel",
            self.tensor_parallel,
            "1 (tensor parallelism is not supported yet: a model runs on one device)",
        )

    def resolve_device(self, cuda_available: bool) -> str:
        """The concrete device; the caller says whether CUDA is usable so config never imports torch."""
        if self.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.device
