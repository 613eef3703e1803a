"""ServerConfig: where the HTTP server listens, who may call it, and its request-level limits."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config._check import check
from tidal.sampling_params import MAX_N

# How chat completions split a model's reasoning from its answer (tidal/server/reasoning.py holds
# the parsers): "auto" picks one from the chat template, "none" returns the text as content.
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
# server/tool_parsers.py's formats (a test keeps the two lists equal).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "deepseek_v3")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer keys accepted on /v1/*; empty means no authentication.
    api_keys: tuple[str, ...] = ()
    # Browser origins allowed to call the API (CORS), e.g. "http://localhost:3000", or "*" for
    # any. Empty: no CORS headers, so a page in the user's browser cannot call a local server
    # (vLLM allows every origin by default).
    allowed_origins: tuple[str, ...] = ()
    # Default whole-request deadline; a request's own `timeout_s` may only shorten it. None: none.
    request_timeout_s: float | None = None
    # Default queue deadline: a request not started within this long ends with 504
    # (finish reason "deadline"); a request's own `queue_timeout_s` may only shorten it. None: none.
    queue_timeout_s: float | None = None
    # Most choices (`n`) one request may ask for; each is a sequence with its own KV blocks.
    max_n: int = 16
    # Most output tokens one request may ask for over all its prompts and choices (prompts x n x
    # max_tokens; a null max_tokens counts as the context left after the prompt). None: the
    # context length (model.max_model_len), so n choices together get one context's worth.
    max_total_output_tokens: int | None = None
    # Bodies above this get 413. 4 MiB holds a 128k-token prompt sent as text or as token ids.
    max_body_bytes: int = 4 << 20
    # How chat replies' tool calls are read (tool_choice auto). None: by the model's chat family
    # (ChatML/Qwen hermes, Llama 3 llama3_json, Mistral mistral, DeepSeek deepseek_v3, else hermes).
    tool_call_parser: str | None = None
    # On shutdown, stop accepting and let running requests finish for up to this long.
    drain_timeout_s: float = 30.0
    # Run one tiny request before /ready turns true (compiles kernels, touches the KV pool).
    warmup: bool = True
    # Run the engine in its own supervised process (restarted when it dies or hangs); false runs
    # it in a thread of the API process.
    engine_process: bool = True
    # Keep a spare engine process that has imported torch and tidal (no weights, no KV), so a
    # restart after a crash or hang skips Python's start-up and the imports (kill-to-ready ~1.1 s
    # instead of ~4.1 s on 2 cores). It costs about 0.24 GB of resident memory. null (the default):
    # none until the engine first fails, one from then on; true: from the start; false: never.
    # Only with engine_process and one replica.
    standby: bool | None = None
    # The engine process counts as hung after this long without progress while it has work.
    watchdog_timeout_s: float = 30.0
    # More than this many engine restarts within engine_restart_window_s: the server exits 1.
    engine_max_restarts: int = 5
    engine_restart_window_s: float = 300.0
    # A stream sends its new text at most this often, coalescing the tokens of the steps in
    # between into one chunk (the seeds' stream_interval); 0 sends every step's tokens at once.
    stream_interval_ms: float = 0.0
    # While a streamed request waits in the queue, send an SSE comment this often so clients and
    # proxies do not time the connection out; 0 sends none (the first byte waits for a token).
    sse_keepalive_s: float = 10.0
    # One log line per finished engine request: its finish, token counts and timings (never the
    # prompt or output text), as TGI and llama.cpp log each request.
    log_requests: bool = True
    # Split <think>...</think> out of chat completions into `reasoning_content`: one of
    # REASONING_PARSERS; "auto" picks deepseek_r1 or qwen3 when the chat template names a think
    # tag.
    reasoning_parser: str = "auto"
    # A Jinja chat template (a file, or the template text) that renders chat requests instead of
    # the checkpoint's default one; its named templates (tool_use, ...) stay. None: the
    # checkpoint's own, or the chat family's built-in one.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        check(
            self.chat_template is None
            or (isinstance(self.chat_template, str) and self.chat_template != ""),
            "server.chat_template",
            self.chat_template,
            "a template file, the template text, or null",
        )
        check(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            "server.tool_call_parser",
            self.tool_call_parser,
            f"null or one of {', '.join(TOOL_CALL_PARSERS)}",
        )
        # A list from YAML or JSON becomes a tuple so the config stays hashable and immutable.
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        check(
            all(isinstance(o, str) and o.strip() != "" for o in self.allowed_origins),
            "allowed_origins",
            self.allowed_origins,
            'origins such as "http://localhost:3000", or "*"',
        )
        check(
            isinstance(self.host, str) and self.host != "",
            "host",
            self.host,
            "a non-empty host name or address",
        )
        check(
            0 <= self.port <= 65535,
            "port",
            self.port,
            "an integer in [0, 65535] (0 picks a free port)",
        )
        # Bearer tokens cannot hold whitespace; the bad key itself is never echoed.
        check(
            all(isinstance(k, str) and k != "" and not any(c.isspace() for c in k) for k in self.api_keys),
            "api_keys", "<masked>", "non-empty strings without whitespace",
        )  # fmt: skip
        check(
            self.request_timeout_s is None or self.request_timeout_s > 0,
            "request_timeout_s",
            self.request_timeout_s,
            "a positive number of seconds or None",
        )
        check(
            self.queue_timeout_s is None or self.queue_timeout_s > 0,
            "queue_timeout_s",
            self.queue_timeout_s,
            "a positive number of seconds or None",
        )
        check(1 <= self.max_n <= MAX_N, "max_n", self.max_n, f"an integer in [1, {MAX_N}]")
        check(
            self.max_total_output_tokens is None or self.max_total_output_tokens >= 1,
            "max_total_output_tokens",
            self.max_total_output_tokens,
            "an integer >= 1 or None",
        )
        check(
            self.max_body_bytes >= 1024, "max_body_bytes", self.max_body_bytes, "an integer >= 1024"
        )
        check(
            self.drain_timeout_s >= 0,
            "drain_timeout_s",
            self.drain_timeout_s,
            "a number of seconds >= 0",
        )
        check(
            self.watchdog_timeout_s > 0,
            "watchdog_timeout_s",
            self.watchdog_timeout_s,
            "a positive number of seconds",
        )
        check(
            self.engine_max_restarts >= 0,
            "engine_max_restarts",
            self.engine_max_restarts,
            "an integer >= 0",
        )
        for name in ("stream_interval_ms", "sse_keepalive_s"):
            value = getattr(self, name)
            check(value >= 0, name, value, "a number >= 0 (0 turns it off)")
        check(
            self.reasoning_parser in REASONING_PARSERS,
            "reasoning_parser",
            self.reasoning_parser,
            f"one of {', '.join(REASONING_PARSERS)}",
        )
        check(
            self.engine_restart_window_s > 0,
            "engine_restart_window_s",
            self.engine_restart_window_s,
            "a positive number of seconds",
        )
