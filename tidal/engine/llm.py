"""LLM: the offline API (vLLM's shape) over the same EngineCore the server uses."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any

from tidal.config.cache import CacheConfig
from tidal.config.engine import EngineConfig
from tidal.config.hardware import HardwareConfig
from tidal.config.model import ModelConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.engine.builder import build_engine
from tidal.engine.output import RequestOutput
from tidal.engine.stats import StepStats
from tidal.loader.chat_template import (
    choose_named_template,
    cut_after_final_message,
    normalize_messages,
)
from tidal.loader.generation_config import model_sampling_defaults
from tidal.sampling_params import SamplingParams

_SECTIONS = {
    "model": ModelConfig,
    "hardware": HardwareConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
}
_ALIASES = {"model": ("model", "path")}


def engine_config_from_kwargs(model: str | None, **kwargs: Any) -> EngineConfig:
    """Flat keyword arguments (max_num_seqs=8, kv_cache_bytes=..., dtype=...) -> EngineConfig."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    sections["model"]["path"] = model
    for key, value in kwargs.items():
        if key == "dtype":
            sections["hardware"]["dtype"] = value
            continue
        if key == "tensor_parallel_size":  # vLLM's name
            sections["hardware"]["tensor_parallel"] = value
            continue
        owner = next(
            (s for s, cls in _SECTIONS.items() if key in {f.name for f in fields(cls)}), None
        )
        if owner is None:
            raise ValueError(f"LLM() got an unknown argument {key!r}")
        sections[owner][key] = value
    return EngineConfig(**{name: cls(**sections[name]) for name, cls in _SECTIONS.items()})


# A prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | dict[str, Any]


class LLM:
    """`LLM(model=None)` serves the bundled Gemma 3 270M; pass a GGUF file or HF directory otherwise.

    >>> outs = LLM().generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> outs[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        on_step: Callable[[StepStats], None] | None = None,
        **kwargs: Any,
    ) -> None:
        """`on_step(stats)` is called after every engine step with its StepStats (the seeds'
        set_monitor): batch and seat utilization, the controller's budget and seat cap, step
        time and the cost model's prediction. It runs inside generate(); keep it cheap."""
        self.config = engine_config_from_kwargs(model, **kwargs)
        self.engine = build_engine(self.config, on_step=on_step)
        self._ids = itertools.count()
        # The checkpoint's recommended sampling (model.generation_config), as vLLM's LLM reads it
        self._sampling_defaults = model_sampling_defaults(
            self.config.model, self.engine.loaded.path
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (they also end with this process)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the checkpoint's
        recommendation (generation_config.json, a GGUF's general.sampling.* keys, with
        `override_generation_config` laid over it) on SamplingParams' own defaults, as vLLM's
        LLM does; `generation_config="none"` leaves SamplingParams() alone."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.
        `use_tqdm`: a progress bar of finished requests on stderr (vLLM's argument)."""
        items = self._normalize(prompts, prompt_token_ids)
        params = sampling_params or self.get_default_sampling_params()
        per = [params] * len(items) if isinstance(params, SamplingParams) else list(params)
        if len(per) != len(items):
            raise ValueError(f"got {len(per)} sampling_params for {len(items)} prompts")
        ids: list[str] = []
        try:
            for i, ((text, token_ids), p) in enumerate(zip(items, per)):
                rid = f"llm-{next(self._ids)}"
                ok = self.engine.add_request(
                    rid, token_ids, p, prompt=text, priority=0 if priority is None else priority[i]
                )
                ids.append(rid)
                if not ok:
                    raise RuntimeError(f"request {i} was rejected: the waiting queue is full")
        except BaseException:
            for rid in ids:  # leave nothing queued behind a failed call
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or several, then generate.

        As vLLM's: `chat_template` is template text to render with instead (or the name of one
        of the checkpoint's templates, "tool_use", ...); `continue_final_message` continues the
        last (assistant) message instead of starting a new one (no generation prompt then);
        `chat_template_kwargs` go to the template, and so do `tools` (OpenAI's function tools,
        for a template that lists them; one that never reads them is a ValueError, not tools
        silently left out). The reply is the model's text: calls are not parsed out of it."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        extra = dict(chat_template_kwargs or {})
        if tools is not None:  # the template apply_chat_template will pick, by its own rule
            named = getattr(tok, "named_chat_templates", {})
            used = choose_named_template(tok.chat_template, named, chat_template, True)
            if "tools" not in (used or ""):
                raise ValueError("tools: this chat template never reads them (name one that does)")
            extra["tools"] = tools
        ids = []
        for conv in (normalize_messages(list(c)) for c in convs):
            text = tok.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                chat_template=chat_template,
                **extra,
            )
            if continue_final_message:
                if not conv or conv[-1]["role"] != "assistant":
                    raise ValueError("continue_final_message needs an assistant message last")
                text = cut_after_final_message(text, str(conv[-1].get("content") or ""))
            ids.append(tok.encode(text, add_special_tokens=False))
        return self.generate(
            sampling_params=sampling_params, prompt_token_ids=ids, use_tqdm=use_tqdm
        )

    def _normalize(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        tok = self.engine.tokenizer
        if prompt_token_ids is not None:
            return [(None, list(ids)) for ids in prompt_token_ids]
        if prompts is None:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if prompts and isinstance(prompts[0], int):
            return [(None, list(prompts))]  # one prompt of token ids
        out = []
        for p in prompts:
            if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt
                p = _prompt_of(p)
            if isinstance(p, str):
                out.append((p, tok.encode(p)))
            else:
                out.append((None, list(p)))
        return out


def _prompt_of(prompt: dict[str, Any]) -> str | list[int]:
    """vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}; nothing else, since
    any other key (multi_modal_data, ...) asks for what tidal would not do."""
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"])
    raise ValueError(
        f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids' and nothing else; got "
        f"{sorted(keys)}"
    )


__all__ = ["LLM", "SamplingParams", "replace"]
