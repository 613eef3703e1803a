"""Layered config: defaults < YAML < env < CLI, errors naming the full key, dump round trip, masking."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import pytest
import yaml

from tidal.config.engine import EngineConfig, TidalConfig
from tidal.config.loader import (
    MASK,
    add_cli_arguments,
    cli_flags_from_args,
    cli_overrides_from_args,
    dump_config,
    load_config,
)
from tidal.config.scheduler import SchedulerConfig
from tidal.config.server import ServerConfig


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tidal.yaml"
    path.write_text(text)
    return str(path)


def _parse(argv: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    return cli_overrides_from_args(parser.parse_args(argv))


def test_nothing_given_is_the_dataclass_defaults() -> None:
    assert load_config(None, {}, {}) == TidalConfig()
    assert _parse([]) == {}


def test_precedence_defaults_file_env_cli(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "server: {port: 8100, host: 0.0.0.0}\n"
        "batching: {max_num_seqs: 8, window_ms: 2}\n"
        "memory: {block_size: 32}\n",
    )
    env = {"TIDAL_SERVER_PORT": "8200", "TIDAL_BATCHING_MAX_NUM_SEQS": "4", "HOME": "/root"}
    cfg = load_config(path, env, _parse(["--port", "8300"]))
    assert cfg.server.port == 8300  # CLI beats env beats file
    assert cfg.engine.scheduler.max_num_seqs == 4  # env beats file
    assert cfg.server.host == "0.0.0.0"  # file beats default
    assert cfg.engine.scheduler.window_ms == 2.0  # YAML int accepted for a float key
    assert cfg.engine.cache.block_size == 32
    assert cfg.engine.scheduler.max_num_batched_tokens == 1024  # untouched default


def test_max_queue_is_set_under_server_and_lands_in_the_scheduler(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "server: {max_queue: 7}\n"), {}, {})
    assert cfg.engine.scheduler.max_queue == 7
    assert (
        load_config(None, {"TIDAL_SERVER_MAX_QUEUE": "none"}, {}).engine.scheduler.max_queue is None
    )
    assert _parse(["--max-queue", "none"]) == {"server.max_queue": None}
    with pytest.raises(ValueError, match=r"unknown config key 'batching.max_queue'"):
        load_config(_write(tmp_path, "batching: {max_queue: 7}\n"), {}, {})


def test_batching_disabled_means_one_sequence(tmp_path: Path) -> None:
    path = _write(tmp_path, "batching: {enabled: false, max_num_seqs: 64}\n")
    assert load_config(path, {}, {}).engine.scheduler.max_num_seqs == 1
    assert load_config(None, {}, _parse(["--no-batching"])).engine.scheduler.max_num_seqs == 1
    # A later layer can turn it back on.
    assert (
        load_config(path, {"TIDAL_BATCHING_ENABLED": "yes"}, {}).engine.scheduler.max_num_seqs == 64
    )


def test_env_parsing_of_lists_bools_sizes_and_nulls() -> None:
    env = {
        "TIDAL_SERVER_API_KEYS": "sk-a, sk-b,,",
        "TIDAL_MEMORY_ENABLE_PREFIX_CACHING": "off",
        "TIDAL_MEMORY_KV_CACHE_BYTES": "2GiB",
        "TIDAL_SERVER_REQUEST_TIMEOUT_S": "12.5",
        "TIDAL_MODEL_MAX_MODEL_LEN": "null",
        "TIDAL_LOG_LEVEL": "debug",  # not a config section: ignored
    }
    cfg = load_config(None, env, {})
    assert cfg.server.api_keys == ("sk-a", "sk-b")
    assert cfg.engine.cache.enable_prefix_caching is False
    assert cfg.engine.cache.kv_cache_bytes == 2 << 30
    assert cfg.server.request_timeout_s == 12.5
    assert cfg.engine.model.max_model_len is None
    assert (
        load_config(None, {"TIDAL_MEMORY_KV_CACHE_BYTES": "2GB"}, {}).engine.cache.kv_cache_bytes
        == 2 * 10**9
    )


def test_cli_flags_map_to_keys() -> None:
    overrides = _parse(
        [
            "--api-key", "k1", "--api-key", "k2", "--no-prefix-caching", "--no-chunked-prefill",
            "--kv-cache-bytes", "512MiB", "--dtype", "bfloat16", "--device", "cuda:1",
            "--max-input-tokens", "900", "--max-model-len", "4096", "--max-num-batched-tokens", "4096",
            "--model", "/m/x.gguf", "--threads", "2", "--window-ms", "5", "--prefix-ttl-s", "60",
            "--block-size", "32", "--request-timeout-s", "30", "--max-num-seqs", "16", "--host", "::1",
        ]
    )  # fmt: skip
    cfg = load_config(None, {"TIDAL_SERVER_API_KEYS": "env-key"}, overrides)
    assert cfg.server.api_keys == ("k1", "k2")  # replaces the env list, not merged
    e = cfg.engine
    assert (e.cache.enable_prefix_caching, e.scheduler.enable_chunked_prefill) == (False, False)
    assert (
        e.cache.kv_cache_bytes == 512 << 20
        and e.cache.block_size == 32
        and e.cache.prefix_ttl_s == 60.0
    )
    assert (e.hardware.dtype, e.hardware.device, e.hardware.threads) == ("bfloat16", "cuda:1", 2)
    assert e.weight_dtype == "bfloat16"  # model.dtype auto follows the compute dtype
    assert (e.limits.max_input_tokens, e.model.max_model_len, e.model.path) == (
        900,
        4096,
        "/m/x.gguf",
    )
    assert (e.scheduler.window_ms, e.scheduler.max_num_seqs) == (5.0, 16)
    assert e.model.huge_pages is True  # the default
    assert load_config(None, {}, _parse(["--no-huge-pages"])).engine.model.huge_pages is False
    assert (cfg.server.request_timeout_s, cfg.server.host) == (30.0, "::1")


def test_vllm_flag_names_set_the_same_keys() -> None:
    vllm = _parse(["--tensor-parallel-size", "2", "-dp", "3", "--enable-prefix-caching",
                   "--no-enable-chunked-prefill"])  # fmt: skip
    own = _parse(["--tensor-parallel", "2", "--data-parallel", "3", "--prefix-caching",
                  "--no-chunked-prefill"])  # fmt: skip
    assert (
        vllm
        == own
        == {
            "hardware.tensor_parallel": 2,
            "hardware.data_parallel": 3,
            "memory.enable_prefix_caching": True,
            "batching.enable_chunked_prefill": False,
        }
    )
    assert _parse(["-tp", "4", "--data-parallel-size", "1"]) == {
        "hardware.tensor_parallel": 4,
        "hardware.data_parallel": 1,
    }


def test_vllm_speculative_config_sets_the_drafting_keys() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    flags = _parse(["--speculative-config", spec])
    assert flags == {
        "batching.num_speculative_tokens": 5,
        "batching.prompt_lookup_max": 3,
        "batching.prompt_lookup_min": 3,  # as vLLM: one bound alone sets the other
    }
    cfg = load_config(None, {}, flags).engine.scheduler
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 3, 3)
    # The same value through tidal's own flag is fine; a different one is refused.
    assert _parse(["--speculative-config", spec, "--num-speculative-tokens", "5"]) == flags
    with pytest.raises(ValueError, match="give one"):
        _parse(["--speculative-config", spec, "--num-speculative-tokens", "2"])
    # vLLM's batch size past which drafting stops is tidal's speculative_max_num_seqs.
    spec = '{"method": "ngram", "disable_by_batch_size": 8}'
    cfg = load_config(None, {}, _parse(["--speculative-config", spec])).engine.scheduler
    assert cfg.speculative_max_num_seqs == 8


def test_a_bad_value_in_speculative_config_is_named_as_coming_from_it() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    for argv, flag in (
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'],
         "--speculative-config"),
        (["--num-speculative-tokens", "-1"], "--num-speculative-tokens"),
    ):  # fmt: skip
        args = parser.parse_args(argv)
        with pytest.raises(ValueError, match=f"from flag {flag}"):
            load_config(None, {}, cli_overrides_from_args(args), cli_flags_from_args(args))


@pytest.mark.parametrize(
    "spec,why",
    [
        ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3}', "not served"),
        ('{"model": "some/draft-model", "num_speculative_tokens": 3}', "a draft model is not"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "draft_tensor_parallel_size"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "integer"),
        ("[1]", "expected a JSON object"),
        ("{method: ngram}", "not JSON"),
    ],
)
def test_speculative_configs_tidal_cannot_honour_are_refused(spec, why, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--speculative-config", spec])
    assert info.value.code == 2 and why in capsys.readouterr().err


def test_serve_takes_the_model_as_vllm_serve_does(tmp_path: Path) -> None:
    from tidal.cli_serve import main

    out = tmp_path / "cfg.yaml"

    def printed(argv: list[str]) -> int:
        with open(out, "w") as fh, contextlib.redirect_stdout(fh):
            return main([*argv, "--print-config"])

    assert printed(["/m/x.gguf", "--max-num-seqs", "4"]) == 0
    assert "path: /m/x.gguf" in out.read_text()
    assert printed(["/m/x.gguf", "--model", "/m/x.gguf"]) == 0  # the same one twice is fine
    assert printed(["/m/x.gguf", "--model", "/m/y.gguf"]) == 2  # two models: refused


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("batching: {max_num_seqs: 0}\n", r"^batching\.max_num_seqs=0 is invalid: expected an integer >= 1 \(from .*tidal\.yaml\)$"),
        ("batching: {max_num_seqs: '8'}\n", r"^batching\.max_num_seqs='8' is invalid: expected an integer \("),
        ("batching: {max_num_seqs: true}\n", r"^batching\.max_num_seqs=True is invalid: expected an integer"),
        ("server: {port: 70000}\n", r"^server\.port=70000 is invalid: expected an integer in \[0, 65535\]"),
        ("server: {api_keys: sk-1}\n", r"^server\.api_keys='<masked>' is invalid: expected a list of strings"),
        ("memory: {memory_fraction: 1.5}\n", r"^memory\.memory_fraction=1\.5 is invalid: expected a number in \(0, 1\]"),
        ("memory: {kv_cache_bytes: lots}\n", r"^memory\.kv_cache_bytes='lots' is invalid: expected a byte count"),
        ("hardware: {device: tpu}\n", r"^hardware\.device='tpu' is invalid: expected auto, cpu, cuda or cuda:<index>"),
        ("hardware: {dtype: fp8}\n", r"^hardware\.dtype='fp8' is invalid: expected one of auto, float32, bfloat16, float16"),
        ("limits: {truncation: right}\n", r"^limits\.truncation='right' is invalid: expected reject or left"),
        ("batching: {max_num_seq: 8}\n", r"^unknown config key 'batching\.max_num_seq' .*batching accepts enabled, max_num_seqs,"),
        ("engine: {x: 1}\n", r"^unknown config section 'engine' .*expected one of model, batching, memory, hardware, limits, server$"),
        ("server: 8000\n", r"^config section 'server' .* must be a mapping"),
        ("- a\n- b\n", r"expected a mapping of sections, got list"),
        ("server: {port: [\n", r"is not valid YAML"),
    ],
)  # fmt: skip
def test_bad_file_values_name_the_full_key(tmp_path: Path, yaml_text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(_write(tmp_path, yaml_text), {}, {})


def test_bad_env_and_cli_values_name_their_source() -> None:
    with pytest.raises(
        ValueError,
        match=r"^batching\.max_num_seqs='many' is invalid: expected an integer \(from environment TIDAL_BATCHING_MAX_NUM_SEQS\)$",
    ):
        load_config(None, {"TIDAL_BATCHING_MAX_NUM_SEQS": "many"}, {})
    with pytest.raises(
        ValueError, match=r"^server\.warmup='maybe' is invalid: expected true or false"
    ):
        load_config(None, {"TIDAL_SERVER_WARMUP": "maybe"}, {})
    with pytest.raises(
        ValueError,
        match=r"^unknown config key 'server\.prot' \(from environment TIDAL_SERVER_PROT\)",
    ):
        load_config(None, {"TIDAL_SERVER_PROT": "1"}, {})
    with pytest.raises(
        ValueError,
        match=r"^server\.max_queue=0 is invalid: expected an integer >= 1 or None \(from flag --max-queue\)$",
    ):
        load_config(None, {}, _parse(["--max-queue", "0"]))
    with pytest.raises(SystemExit):  # argparse reports the same message and exits 2
        _parse(["--port", "eighty"])


def test_cross_section_checks_name_both_keys() -> None:
    with pytest.raises(
        ValueError,
        match=r"^limits\.max_input_tokens=5000 is invalid: expected at most model\.max_model_len \(4096\)$",
    ):
        load_config(None, {}, {"limits.max_input_tokens": 5000, "model.max_model_len": 4096})
    with pytest.raises(
        ValueError,
        match=r"^batching\.max_num_batched_tokens=16 is invalid: expected at least batching\.max_num_seqs \(32\)$",
    ):
        load_config(None, {}, {"batching.max_num_batched_tokens": 16})
    with pytest.raises(ValueError, match=r"when batching\.enable_chunked_prefill is false$"):
        load_config(
            None, {}, {"batching.enable_chunked_prefill": False, "model.max_model_len": 8192}
        )


def test_dump_round_trips_and_masks_secrets(tmp_path: Path) -> None:
    overrides = {"server.api_keys": ["sk-secret-1", "sk-secret-2"], "server.max_queue": None, "batching.max_num_seqs": 3,
                 "memory.kv_cache_bytes": "1G", "model.served_model_name": "gemma", "limits.truncation": "left"}  # fmt: skip
    cfg = load_config(None, {}, overrides)
    masked = dump_config(cfg)
    assert "sk-secret" not in masked
    assert yaml.safe_load(masked)["server"]["api_keys"] == [MASK, MASK]
    # A masked dump is refused rather than trusted with a public key.
    with pytest.raises(ValueError, match=r"^server\.api_keys='<masked>' is invalid"):
        load_config(_write(tmp_path, masked), {}, {})
    assert load_config(_write(tmp_path, dump_config(cfg, mask_secrets=False)), {}, {}) == cfg
    # The dump has the documented shape: every section, batching.enabled, server.max_queue.
    sections = yaml.safe_load(masked)
    assert list(sections) == ["model", "batching", "memory", "hardware", "limits", "server"]
    assert sections["batching"]["enabled"] is True and sections["server"]["max_queue"] is None
    assert sections["memory"]["kv_cache_bytes"] == 1 << 30


def test_disabled_batching_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, {}, {"batching.enabled": False})
    dumped = yaml.safe_load(dump_config(cfg))["batching"]
    assert (dumped["enabled"], dumped["max_num_seqs"]) == (False, 1)
    assert load_config(_write(tmp_path, dump_config(cfg)), {}, {}) == cfg


def test_empty_file_and_empty_sections_are_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, ""), {}, {}) == TidalConfig()
    assert load_config(_write(tmp_path, "server:\nmodel: {}\n"), {}, {}) == TidalConfig()


def test_dataclasses_stay_usable_directly() -> None:
    # Components construct their section configs without the loader; the chain defaults hold.
    cfg = TidalConfig(
        engine=EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)),
        server=ServerConfig(api_keys=["k"]),
    )  # type: ignore[arg-type]
    assert cfg.server.api_keys == ("k",)
    assert hash(cfg) == hash(
        TidalConfig(
            engine=EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)),
            server=ServerConfig(api_keys=("k",)),
        )
    )
