"""sampling_defaults: the sampling settings a checkpoint recommends, as defaults for requests.

A checkpoint's authors often say how it should be sampled: DeepSeek-R1's distills want
temperature 0.6 and top_p 0.95 (at 1.0 they ramble or repeat), Qwen2.5's instruct models
temperature 0.7, top_p 0.8, top_k 20 and repetition_penalty 1.05. vLLM reads these from
generation_config.json (`--generation-config auto`, its default) and llama.cpp from a GGUF's
`general.sampling.*` keys, and both use them for every field a request leaves unset. tidal does
the same, so a model answers alike whichever of the three serves it.

Read without torch or numpy: the API process calls this.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from tidal.config.model import GENERATION_FIELDS, ModelConfig
from tidal.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# llama.cpp's names for the settings tidal honours (its others, mirostat, xtc and typical_p,
# are samplers tidal does not have: a file that sets them gets tidal's sampling without them).
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# A generation_config.json field -> the SamplingParams field it sets.
_PARAM = {name: name for name in GENERATION_FIELDS} | {"max_new_tokens": "max_tokens"}


def sampling_defaults(model: ModelConfig, model_root: str | Path) -> tuple[dict[str, float], str]:
    """SamplingParams fields -> values for what a request leaves unset, and where they came
    from (for the log). `model_root` is the checkpoint actually loaded (a GGUF file or a HF
    folder). ValueError names the source and field when a value is not one tidal can sample
    with (the file is the model's, so it is not silently dropped)."""
    choice = model.generation_config.strip()
    found: dict[str, float] = {}
    source = ""
    if choice.lower() == "auto":
        found, source = _read_checkpoint(Path(model_root))
    elif choice.lower() != "none":
        found, source = _read_json(_json_path(Path(choice).expanduser())), choice
    overrides = model.generation_overrides()
    if overrides:
        found.update(overrides)
        source = (
            f"{source} + override_generation_config" if source else "override_generation_config"
        )
    try:
        params = {_PARAM[k]: _number(k, v) for k, v in found.items()}
        SamplingParams(**params)
    except ValueError as e:
        raise ValueError(
            f"{source}: {e} (model.generation_config none, or an override, replaces it)"
        ) from None
    return params, source


def _read_checkpoint(root: Path) -> tuple[dict[str, float], str]:
    if root.is_dir():
        path = root / "generation_config.json"
        found = _read_json(path) if path.is_file() else {}
        return found, str(path) if found else ""
    if root.suffix.lower() != ".gguf" or not root.is_file():
        return {}, ""
    from tidal.loader.gguf_file import ARCH_STRINGS_DECODED, GGUFFile

    with GGUFFile(str(root), count_strings_over=ARCH_STRINGS_DECODED, header_only=True) as f:
        found = {name: f.metadata[key] for key, name in GGUF_KEYS.items() if key in f.metadata}
    for name, value in found.items():
        if isinstance(value, float) and math.isfinite(value):  # float32: 0.6, not 0.6000000238
            found[name] = float(f"{value:.7g}")
    return found, f"{root} (general.sampling.*)" if found else ""


def _json_path(path: Path) -> Path:
    if path.is_dir():
        path = path / "generation_config.json"
    if not path.is_file():
        raise ValueError(
            f"model.generation_config={str(path)!r} is invalid: expected auto, none, or a folder "
            "holding generation_config.json"
        )
    return path


def _read_json(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable generation config ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a generation config (expected a JSON object)")
    # HF writes null for fields left at its default: only set ones are recommendations.
    return {k: data[k] for k in GENERATION_FIELDS if data.get(k) is not None}


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid: expected a number")
    if name in ("top_k", "max_new_tokens"):
        if value != int(value):
            raise ValueError(f"{name}={value!r} is invalid: expected a whole number")
        return int(value)
    return float(value)


def model_sampling_defaults(model: ModelConfig, model_root: str | Path) -> dict[str, float]:
    """`sampling_defaults`, logged where there are any: a user who expected OpenAI's defaults
    learns why unset fields sample otherwise, and how to turn it off (vLLM warns alike)."""
    params, source = sampling_defaults(model, model_root)
    if params:
        shown = ", ".join(f"{k}={v:g}" for k, v in params.items())
        log.info(
            "requests that leave them unset sample with %s (from %s; "
            "--generation-config none for OpenAI's defaults)",
            shown,
            source,
        )
    return params
