"""read_arch_config: a checkpoint's ArchConfig from its header alone (HF config.json or GGUF metadata), without torch or numpy."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.config.arch import ArchConfig, arch_from_gguf, arch_from_hf


def read_arch_config(path: str | Path) -> ArchConfig:
    """The ArchConfig of a checkpoint, for a process that never loads the model (the API
    process): neither torch nor numpy is imported.

    The same answer as `model_loader.read_arch(path)[0]`, which also reads the rope frequency
    tensor and so needs torch.
    """
    p = Path(path)
    if p.is_dir():
        config = p / "config.json"
        if not config.exists():
            raise ValueError(
                f"{p} is a directory without config.json; expected a HF model directory"
            )
        return arch_from_hf(json.loads(config.read_text()))
    if not p.exists():
        raise ValueError(f"model path {str(p)!r} does not exist")
    from tidal.loader.gguf_file import ARCH_STRINGS_DECODED, GGUFFile

    with GGUFFile(str(p), count_strings_over=ARCH_STRINGS_DECODED, header_only=True) as f:
        return arch_from_gguf(f.metadata, "output.weight" in f.tensors)
