"""Section dataclasses: validation messages, device resolution, served model names, byte sizes."""

from __future__ import annotations

import pytest

from tidal.config.hardware import HardwareConfig
from tidal.config.keys import parse_bytes
from tidal.config.limits import LimitsConfig
from tidal.config.model import ModelConfig
from tidal.config.server import ServerConfig


def test_device_auto_resolves_from_the_callers_cuda_flag() -> None:
    assert HardwareConfig().resolve_device(cuda_available=True) == "cuda"
    assert HardwareConfig().resolve_device(cuda_available=False) == "cpu"
    assert HardwareConfig(device="cuda:1").resolve_device(cuda_available=False) == "cuda:1"


@pytest.mark.parametrize(
    ("path", "served", "expected"),
    [
        (None, None, "bundled"),
        ("/models/gemma-3-270m-q4_k_m.gguf", None, "gemma-3-270m-q4_k_m"),
        ("/models/Qwen2-0.5B/", None, "Qwen2-0.5B"),
        ("/models/x.gguf", "my-model", "my-model"),
    ],
)
def test_served_name(path: str | None, served: str | None, expected: str) -> None:
    assert ModelConfig(path=path, served_model_name=served).served_name("bundled") == expected


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: ModelConfig(max_model_len=0),
            r"^max_model_len=0 is invalid: expected an integer >= 1 or None$",
        ),
        (lambda: ModelConfig(path=""), r"^path='' is invalid"),
        (
            lambda: ModelConfig(huge_pages="yes"),  # type: ignore[arg-type]
            r"^huge_pages='yes' is invalid: expected true or false$",
        ),
        (
            lambda: HardwareConfig(threads=0),
            r"^threads=0 is invalid: expected an integer >= 1 or None$",
        ),
        (lambda: HardwareConfig(tensor_parallel=0), r"^tensor_parallel=0 is invalid"),
        (lambda: LimitsConfig(max_input_tokens=0), r"^max_input_tokens=0 is invalid"),
        (lambda: ServerConfig(api_keys=("ok", " padded")), r"^api_keys='<masked>' is invalid"),
        (
            lambda: ServerConfig(max_body_bytes=10),
            r"^max_body_bytes=10 is invalid: expected an integer >= 1024$",
        ),
        (lambda: ServerConfig(request_timeout_s=0.0), r"^request_timeout_s=0\.0 is invalid"),
    ],
)
def test_section_validation(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_bad_api_key_value_is_never_echoed() -> None:
    with pytest.raises(ValueError) as info:
        ServerConfig(api_keys=("sk-real secret",))
    assert "sk-real" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1 << 20),
        ("4G", 4 << 30),
        ("4GiB", 4 << 30),
        ("4gb", 4 * 10**9),
        ("512 MiB", 512 << 20),
        ("1.5K", 1536),
        ("7B", 7),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_junk() -> None:
    with pytest.raises(ValueError, match="is not a byte count"):
        parse_bytes("4 gigs")
