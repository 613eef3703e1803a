"""KEY_DOCS: the one table of what every config key does, its flag and the value the example shows.

`tidal serve --help`, examples/tidal.yaml and the key list in docs/serving.md are all generated
from it (`python -m tidal.config.reference --write`), and a test fails when a key of
`tidal.config.keys.KEYS` has no entry here or a committed file differs from what it generates.
"""

from __future__ import annotations

from dataclasses import dataclass


class _Default:
    """The marker for "the example shows the dataclass default"."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()


@dataclass(frozen=True, slots=True)
class KeyDoc:
    """One key's documentation: `text` is its --help, its docs line and its YAML comment."""

    text: str
    flag: str | None = None  # None: set it in the file or as TIDAL_<SECTION>_<KEY>
    example: object = DEFAULT  # the value examples/tidal.yaml sets ("1GiB" for sizes)
    note: str | None = None  # a comment line the example prints above the key
    # vLLM's names for the same setting, so a vLLM command line runs as it is
    aliases: tuple[str, ...] = ()


KEY_DOCS: dict[str, KeyDoc] = {
    # ---- model
    "model.path": KeyDoc(
        "a .gguf file or a safetensors folder; null: the bundled Gemma 3 270M", "--model"
    ),
    "model.dtype": KeyDoc(
        "dtype weights are held in after loading; auto follows hardware.dtype", "--weight-dtype"
    ),
    "model.max_model_len": KeyDoc(
        "context limit (prompt + output); null: the checkpoint's own", "--max-model-len", 4096
    ),
    "model.served_model_name": KeyDoc(
        'the id /v1/models lists and requests send as "model"; null: the file or folder name',
        "--served-model-name",
        "gemma-3-270m",
    ),
    "model.quantization": KeyDoc(
        "weight format: auto (a GGUF's own blocks with int8 activations on CPU, else float), "
        "gguf-q8, gguf (float activations), none, int8, int4, fp8; check one with tidal "
        "quantize-check",
        "--quantization",
    ),
    "model.weight_cache": KeyDoc(
        "float and re-quantized modes: save a GGUF's dequantized weights beside it, so a "
        "restart memory-maps them (~4 bytes per parameter in float32)"
    ),
    "model.huge_pages": KeyDoc(
        "GGUF blocks on CPU: move a matrix of 32 MiB or more (the LM head) into transparent huge "
        "pages once the engine is ready (faster decode; the copy is the process's own); false: "
        "keep it mapped from the file, shared with other processes on the same file",
        "--huge-pages",
    ),
    "model.generation_config": KeyDoc(
        "defaults for the sampling fields a request leaves unset: auto takes the checkpoint's "
        "recommendation (generation_config.json, a GGUF's general.sampling.* keys: temperature, "
        "top_p, top_k, min_p, repetition_penalty, max_new_tokens); none: OpenAI's defaults; or a "
        "folder holding a generation_config.json",
        "--generation-config",
    ),
    "model.override_generation_config": KeyDoc(
        'a JSON object laid over those defaults, e.g. \'{"temperature": 0.6, "top_p": 0.95}\'',
        "--override-generation-config",
    ),
    # ---- batching
    "batching.enabled": KeyDoc(
        "continuous batching; false: one sequence at a time (forces max_num_seqs to 1)",
        "--batching",
    ),
    "batching.max_num_seqs": KeyDoc("most sequences in one engine step", "--max-num-seqs"),
    "batching.min_num_seqs": KeyDoc(
        "with target_tpot_ms: the lowest seat cap the controller may set (at most max_num_seqs)",
        "--min-num-seqs",
    ),
    "batching.max_num_batched_tokens": KeyDoc(
        "most tokens in one step (decodes take 1 each, prefill chunks the rest); the budget "
        "itself on a GPU without a target",
        "--max-num-batched-tokens",
    ),
    "batching.target_tpot_ms": KeyDoc(
        "e.g. 150: size each step (prefill chunk, seat cap) so decodes take about this per "
        "output token, from a step cost model learned while serving; null: no target",
        "--target-tpot-ms",
    ),
    "batching.target_ttft_ms": KeyDoc(
        "e.g. 10000: raise the prefill share when queued requests would miss this first-token "
        "time; null: no target",
        "--target-ttft-ms",
    ),
    "batching.cpu_budget_step_ms": KeyDoc(
        "no target, on CPU: prefill what fits a step this long; null: the fixed "
        "max_num_batched_tokens",
        "--cpu-budget-step-ms",
    ),
    "batching.enable_chunked_prefill": KeyDoc(
        "split long prompts across steps so decodes keep flowing",
        "--chunked-prefill",
        aliases=("--enable-chunked-prefill",),
    ),
    "batching.window_ms": KeyDoc(
        "the admission window: when idle, wait up to this long to gather arriving prefills "
        "into one step (the seed layout's dynamic_window); 0: none",
        "--window-ms",
    ),
    "batching.num_speculative_tokens": KeyDoc(
        "prompt-lookup speculative decoding: up to this many tokens guessed from where the "
        "last tokens occurred earlier in the prompt or output, checked in one step; outputs "
        "are the same as without (0: off)",
        "--num-speculative-tokens",
    ),
    "batching.speculative_max_num_seqs": KeyDoc(
        "drafts only in steps with at most this many decoding sequences",
        "--speculative-max-num-seqs",
    ),
    "batching.speculative_step_rows": KeyDoc(
        "a decode step's fixed cost (reading the weights) in batch rows: a draft token is "
        "checked where its chance of being kept, from its sequence's recent drafts, is worth "
        "one more row at that price",
        "--speculative-step-rows",
    ),
    "batching.prompt_lookup_max": KeyDoc(
        "the longest suffix prompt lookup searches for (tried first)", "--prompt-lookup-max"
    ),
    "batching.prompt_lookup_min": KeyDoc(
        "the shortest suffix prompt lookup searches for", "--prompt-lookup-min"
    ),
    "batching.priority_aging_s": KeyDoc(
        "a waiting request gains one priority level per this many seconds, so none starves",
        "--priority-aging-s",
    ),
    "batching.length_aging_tokens_per_s": KeyDoc(
        "among prefills of one level shorter ones go first; a second of waiting is worth this "
        "many tokens of length, so long prompts are not starved"
    ),
    # ---- memory
    "memory.block_size": KeyDoc("tokens per KV block (a multiple of 8)", "--block-size"),
    "memory.kv_cache_bytes": KeyDoc(
        "KV pool size, e.g. 2GiB; null: sized from memory_fraction", "--kv-cache-bytes", "1GiB"
    ),
    "memory.kv_cache_tokens": KeyDoc(
        "KV pool size in tokens that always fit over max_num_seqs sequences (llama.cpp's -c "
        "without --swa-full: sliding-window layers get the pages their windows can hold); "
        "null: sized by kv_cache_bytes or memory_fraction",
        "--kv-cache-tokens",
    ),
    "memory.memory_fraction": KeyDoc(
        "without kv_cache_bytes: the share of free GPU memory / available RAM for the KV pool",
        "--memory-fraction",
    ),
    "memory.max_cpu_kv_bytes": KeyDoc(
        "cap on the KV pool when running on the CPU", "--max-cpu-kv-bytes", "1GiB"
    ),
    "memory.enable_prefix_caching": KeyDoc(
        "reuse the KV of shared prompt prefixes (system prompts, chat turns); the seed "
        "layout's attention_cache",
        "--prefix-caching",
        aliases=("--enable-prefix-caching",),
    ),
    "memory.prefix_ttl_s": KeyDoc(
        "drop idle cached blocks after this many seconds", "--prefix-ttl-s"
    ),
    "memory.session_turns": KeyDoc(
        "turns kept per session_id ahead of anonymous cached blocks", "--session-turns"
    ),
    "memory.kv_cache_dtype": KeyDoc(
        "KV cache storage: auto (float16 over a GGUF's own blocks, else the model's dtype), "
        "float32, float16 or bfloat16 (half of float32's bytes), int8 or fp8 (about twice the "
        "tokens of 16 bits in the same bytes); bfloat16 and 8 bits gated like quantized weights",
        "--kv-cache-dtype",
    ),
    "memory.quantization_gate": KeyDoc(
        "measure perplexity against float before serving a quantized model or KV cache",
        "--quantization-gate",
    ),
    "memory.quantization_gate_threshold_pct": KeyDoc(
        "the largest perplexity rise (percent) the gate accepts"
    ),
    "memory.quantization_gate_max_tokens": KeyDoc(
        "score only the first N held-out tokens (faster, noisier); null: all of them"
    ),
    "memory.force_quantization": KeyDoc(
        "serve a quantized mode even when the gate measures a rise past the threshold",
        "--force-quantization",
    ),
    # ---- hardware
    "hardware.device": KeyDoc(
        "auto (cuda when visible, else cpu), cpu, cuda or cuda:N", "--device"
    ),
    "hardware.dtype": KeyDoc("compute dtype: auto, float32, bfloat16 or float16", "--dtype"),
    "hardware.threads": KeyDoc(
        "torch CPU threads (split between tensor-parallel ranks); null: torch's default",
        "--threads",
    ),
    "hardware.tensor_parallel": KeyDoc(
        "ranks one model is split across (tensor parallel; processes on CPU, one GPU each on "
        "CUDA); it must divide the attention heads; CPU threads are split between ranks",
        "--tensor-parallel",
        aliases=("--tensor-parallel-size", "-tp"),
    ),
    "hardware.distributed_executor_backend": KeyDoc(
        "where tensor-parallel ranks run: mp (local processes) or ray (Ray actors in a "
        "placement group, several machines; needs the ray extra)",
        "--distributed-executor-backend",
    ),
    "hardware.collective_timeout_s": KeyDoc(
        "seconds a tensor-parallel collective may wait for a rank before the group is lost "
        "and restarted (a hung or unreachable rank)",
        "--collective-timeout-s",
    ),
    "hardware.data_parallel": KeyDoc(
        "engine replicas behind one API process, routed by session, cached prefix and load; "
        "each is a supervised process with the whole model, and CPU threads are split between "
        "them (hardware.threads is per replica; null: cores / N)",
        "--data-parallel",
        aliases=("--data-parallel-size", "-dp"),
    ),
    # ---- limits
    "limits.max_input_tokens": KeyDoc(
        "longest prompt accepted; null: the context limit", "--max-input-tokens", 3072
    ),
    "limits.truncation": KeyDoc(
        "over-long prompts: reject (400) or left (drop the oldest tokens, keep the system prompt)",
        "--truncation",
    ),
    # ---- server
    "server.host": KeyDoc("address to listen on; 0.0.0.0: every interface", "--host"),
    "server.port": KeyDoc(
        'port to listen on; 0 picks a free one (printed in the "listening on" line)', "--port"
    ),
    "server.api_keys": KeyDoc(
        "accepted bearer keys; empty: no authentication (--api-key repeats, replacing "
        "file and environment keys)",
        "--api-key",
        note="Keep keys out of files you commit: set TIDAL_SERVER_API_KEYS=key1,key2 or pass "
        "--api-key.",
    ),
    "server.allowed_origins": KeyDoc(
        'browser origins allowed to call the API (CORS; --allowed-origin repeats), "*" for any; '
        "empty: no CORS headers",
        "--allowed-origin",
    ),
    "server.max_queue": KeyDoc(
        "waiting requests beyond this get 429; null: unbounded", "--max-queue", 256
    ),
    "server.request_timeout_s": KeyDoc(
        "default deadline of a whole request (504); a request's timeout_s may only shorten "
        "it; null: none",
        "--request-timeout-s",
        120.0,
    ),
    "server.queue_timeout_s": KeyDoc(
        "default queue deadline: a request not started within this long gets 504; a "
        "request's queue_timeout_s may only shorten it; null: none",
        "--queue-timeout-s",
    ),
    "server.max_n": KeyDoc(
        "most choices (n) one request may ask for (400 above it; at most 128)", "--max-n"
    ),
    "server.max_total_output_tokens": KeyDoc(
        "most output tokens one request may ask for: prompts x n x max_tokens (400 above it); "
        "null: the context length",
        "--max-total-output-tokens",
    ),
    "server.tool_call_parser": KeyDoc(
        "how tool calls are read from chat replies (hermes, llama3_json, mistral, deepseek_v3); "
        "null: by the model's chat family",
        "--tool-call-parser",
    ),
    "server.max_body_bytes": KeyDoc("larger request bodies get 413", "--max-body-bytes", "4MiB"),
    "server.drain_timeout_s": KeyDoc(
        "on SIGTERM, let running requests finish for up to this long", "--drain-timeout-s"
    ),
    "server.warmup": KeyDoc(
        "run a tiny request before /ready answers 200 (retried with backoff if it fails)",
        "--warmup",
    ),
    "server.engine_process": KeyDoc(
        "run the engine in its own supervised process; false: a thread of the API process"
    ),
    "server.standby": KeyDoc(
        "keep a spare engine process (torch imported, no weights) so a restart skips the "
        "imports; about 0.24 GB of RSS. null: from the engine's first failure on",
        "--standby",
    ),
    "server.watchdog_timeout_s": KeyDoc(
        "an engine with work and no progress this long counts as hung and is restarted"
    ),
    "server.engine_max_restarts": KeyDoc(
        "more restarts than this within engine_restart_window_s: the server exits 1"
    ),
    "server.engine_restart_window_s": KeyDoc("the window engine_max_restarts counts in"),
    "server.stream_interval_ms": KeyDoc(
        "a stream sends new text at most this often, the tokens in between merged; 0: every step",
        "--stream-interval-ms",
    ),
    "server.sse_keepalive_s": KeyDoc(
        "SSE comment this often while a streamed request waits in the queue; 0: none",
        "--sse-keepalive-s",
    ),
    "server.log_requests": KeyDoc(
        "log one line per finished request: finish reason, prompt/cached/output tokens, queue "
        "time, first-token time, total time and decode rate (no prompt or output text)",
        "--log-requests",
        aliases=("--enable-log-requests",),
    ),
    "server.chat_template": KeyDoc(
        "a Jinja chat template file (or the template text) that renders chat requests instead of "
        "the checkpoint's; null: the checkpoint's own",
        "--chat-template",
    ),
    "server.reasoning_parser": KeyDoc(
        "split the think block out of chat answers into reasoning_content: auto (from the chat "
        "template), none, deepseek_r1, qwen3",
        "--reasoning-parser",
    ),
}


@dataclass(frozen=True, slots=True)
class SeedKey:
    """A name from the seed's `fastgpt_config.yaml` layout, and what tidal does with it."""

    target: str | None  # the tidal key it sets; None: refused
    text: str


# Read only from a YAML file (the seed's layout had no environment variables or flags). The
# seed nests its sections under `optimization:`; the loader takes that wrapper too.
SEED_KEYS: dict[str, SeedKey] = {
    "batching.dynamic_window": SeedKey(
        "batching.window_ms",
        "milliseconds (20), a duration ('20ms', '0.02s'), true (20 ms) or false (0: none)",
    ),
    "memory.attention_cache": SeedKey("memory.enable_prefix_caching", "true or false"),
    "memory.checkpoint_interval": SeedKey(
        None,
        "gradient checkpointing, a training setting: it trades recomputed activations in the "
        "backward pass for memory, and inference runs no backward pass, so it has no meaning "
        "for serving; remove it",
    ),
}
