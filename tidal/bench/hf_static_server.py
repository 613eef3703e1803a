"""BENCHMARK BASELINE: a static-batching OpenAI-style completions server over HF transformers (not a serving path)."""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the string annotation here

# What this baseline does, on purpose, because it is what static batching is:
#   - it waits for a request, takes every request waiting then (up to --batch-size) as one batch,
#   - pads the prompts to the longest (left padding) and runs one `model.generate` on the batch,
#   - admits nothing new until the whole batch ends: rows that finished early keep their slot.
# It serves /v1/completions (streaming or not, greedy only), /v1/models, /ready, /health, /metrics.


@dataclass(slots=True)
class Job:
    """One request waiting for, or running in, a batch; events go to `events` on the server loop."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # ("text", str) ... then ("done", finish_reason)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False

    def emit(self, kind: str, value: str) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class BatchStreamer:
    """transformers' streamer protocol for a whole batch: `put` gets the (B,) new tokens of a step."""

    def __init__(self, jobs: list[Job], tokenizer: Any, eos_ids: set[int]) -> None:
        self.jobs, self.tok, self.eos_ids = jobs, tokenizer, eos_ids
        self.seen_prompt = False

    def put(self, value: Any) -> None:
        if not self.seen_prompt:  # generate() first hands over the prompt ids
            self.seen_prompt = True
            return
        for job, tok_id in zip(self.jobs, value.reshape(len(self.jobs), -1)[:, -1].tolist()):
            if job.done:
                continue  # finished rows keep computing padding: the static-batching cost
            if tok_id in self.eos_ids and not job.ignore_eos:
                self._finish(job, "stop")
                continue
            job.token_ids.append(tok_id)
            text = self.tok.decode(job.token_ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # hold half a UTF-8 character back
                job.emit("text", text[len(job.text) :])
                job.text = text
            if len(job.token_ids) >= job.max_tokens:
                self._finish(job, "length")

    def end(self) -> None:
        for job in self.jobs:
            if not job.done:
                self._finish(job, "length")

    def _finish(self, job: Job, reason: str) -> None:
        job.done = True
        job.emit("done", reason)


class StaticBatchServer:
    """The model, the waiting queue and the one batching thread."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, collect_s: float) -> None:
        self.model, self.tok = model, tokenizer
        self.batch_size, self.collect_s = batch_size, collect_s
        self.waiting: queue.Queue[Job] = queue.Queue()
        self.num_running = 0
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) - {None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            jobs = [self.waiting.get()]
            time.sleep(self.collect_s)  # let requests that arrive together share the batch
            while len(jobs) < self.batch_size:
                try:
                    jobs.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            self.num_running = len(jobs)
            try:
                self._run_batch(jobs)
            except Exception as e:  # a failed batch fails its requests, not the server
                for job in jobs:
                    if not job.done:
                        job.done = True
                        job.emit("error", f"{type(e).__name__}: {e}")
            finally:
                self.num_running = 0

    def _run_batch(self, jobs: list[Job]) -> None:
        import torch

        width = max(len(j.prompt_ids) for j in jobs)
        # Left padding: every row's last prompt token sits at the same position.
        ids = [[self.pad_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in jobs]
        mask = [[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs]
        max_new = max(j.max_tokens for j in jobs)
        kwargs: dict[str, Any] = {}
        if any(j.ignore_eos for j in jobs):
            kwargs["min_new_tokens"] = max_new  # EOS suppressed: those rows run to max_tokens
        with torch.inference_mode():
            self.model.generate(
                input_ids=torch.tensor(ids),  # (B, width)
                attention_mask=torch.tensor(mask),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=BatchStreamer(jobs, self.tok, self.eos_ids),
                **kwargs,
            )


def build_app(server: StaticBatchServer, served_name: str) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="hf-static benchmark baseline")

    @app.get("/ready")
    @app.get("/health")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_name, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        body = (
            "# TYPE hf_static:num_requests_waiting gauge\n"
            f"hf_static:num_requests_waiting {server.waiting.qsize()}\n"
            "# TYPE hf_static:num_requests_running gauge\n"
            f"hf_static:num_requests_running {server.num_running}\n"
        )
        return PlainTextResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = server.tok(prompt)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            msg = "prompt is invalid: expected a string or a list of token ids"
            return JSONResponse({"error": {"message": msg}}, status_code=400)
        max_tokens = int(body.get("max_tokens") or 16)
        job = Job(prompt_ids, max_tokens, bool(body.get("ignore_eos")), asyncio.get_running_loop(), asyncio.Queue())  # fmt: skip
        server.waiting.put(job)
        rid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())

        def usage() -> dict[str, int]:
            n_in, n_out = len(prompt_ids), len(job.token_ids)
            return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

        def chunk(text: str, reason: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": served_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": reason}]}  # fmt: skip

        if not body.get("stream"):
            parts, reason = [], "length"
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    parts.append(value)
                elif kind == "error":
                    return JSONResponse({"error": {"message": value}}, status_code=500)
                else:
                    reason = value
                    break
            return {**chunk("".join(parts), reason), "usage": usage()}

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> Any:
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield f"data: {json.dumps(chunk(value, None))}\n\n"
                elif kind == "error":
                    yield f"data: {json.dumps({'error': {'message': value}})}\n\n"
                    break
                else:
                    yield f"data: {json.dumps(chunk('', value))}\n\n"
                    break
            if include_usage:
                yield f"data: {json.dumps({**chunk('', None), 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def load(model_path: Path, threads: int) -> tuple[Any, Any]:
    """A GGUF file through transformers (dequantized to float32: slow, a minute or more), or an
    HF checkpoint folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    if model_path.is_dir():
        where, extra = model_path, {}
    else:
        where, extra = model_path.parent, {"gguf_file": model_path.name}
    tok = AutoTokenizer.from_pretrained(where, **extra)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **extra)
    model.eval()
    return model, tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tidal.bench.hf_static_server", description=__doc__)
    p.add_argument(
        "--model", default=None, help="GGUF file or HF folder (default: the bundled model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--collect-ms", type=float, default=20.0, help="wait this long to fill a batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--served-model-name", default=None)
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size={args.batch_size} is invalid: expected an integer >= 1")
    import uvicorn

    if args.model is None:
        from tidal.loader.bundled import bundled_model_path

        args.model = str(bundled_model_path())
    path = Path(args.model)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    start = time.perf_counter()
    print(f"hf-static: loading {path} with transformers (slow)", flush=True)
    model, tok = load(path, args.threads)
    print(f"hf-static: loaded in {time.perf_counter() - start:.0f} s", flush=True)
    server = StaticBatchServer(model, tok, args.batch_size, args.collect_ms / 1000.0)
    app = build_app(server, args.served_model_name or path.stem)
    host, port = sock.getsockname()[:2]
    sys.stdout.write(f"hf-static: BASELINE listening on http://{host}:{port}\n")  # one write
    sys.stdout.flush()
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
