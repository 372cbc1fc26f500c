"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from llmserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from llmserve.engine.core import EngineCore
from llmserve.engine.output_processor import OutputProcessor, SequenceDelta
from llmserve.models.loader import DEFAULT_MODEL
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
Conversation = list[dict[str, Any]]


class LLM:
    """Generates for many prompts at once through the continuous-batching engine."""

    def __init__(self, model: str | os.PathLike[str] = DEFAULT_MODEL, *, device: str = "cpu",
                 max_model_len: int | None = None, block_size: int | None = None,
                 kv_cache_memory: float | None = None, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64, scheduling: str = "continuous",
                 policy: str = "fcfs", enable_chunked_prefill: bool = True,
                 seed: int = 0, quantization: str = "auto", dtype: str | None = None,
                 int4_group_size: int = 32, kv_cache_dtype: str = "auto",
                 enforce_eager: bool = False,
                 hybrid_kv_cache: bool = True,
                 async_scheduling: bool | None = None,
                 speculative_config: dict[str, Any] | SpeculativeConfig | None = None) -> None:
        if speculative_config is not None and not isinstance(speculative_config,
                                                             SpeculativeConfig):
            speculative_config = SpeculativeConfig.from_json(speculative_config)
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        config = EngineConfig(
            model=ModelConfig(model=model, device=device, max_model_len=max_model_len,
                              quantization=quantization, dtype=dtype,
                              int4_group_size=int4_group_size, enforce_eager=enforce_eager),
            cache=CacheConfig(block_size=block_size, kv_cache_memory_gib=kv_cache_memory,
                              num_blocks=num_kv_blocks,
                              enable_prefix_caching=enable_prefix_caching,
                              kv_cache_dtype=kv_cache_dtype,
                              hybrid_kv_cache=hybrid_kv_cache),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs, scheduling=scheduling,
                                      policy=policy,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      async_scheduling=async_scheduling),
            seed=seed,
            speculative=speculative_config,
        )
        self._init(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._init(config)
        return llm

    def _init(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``.
        """
        if isinstance(prompts, str | dict) or (isinstance(prompts, list | tuple) and prompts
                                              and isinstance(prompts[0], int | float)):
            prompts = [prompts]  # one prompt (a float is a wrong token id, named below)
        if not isinstance(prompts, list | tuple):
            raise TypeError(f"prompts: a prompt ({_PROMPT_KINDS}) or a list of them, got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None and (len(priority) != len(prompts) or not all(
                isinstance(p, int) and not isinstance(p, bool) for p in priority)):
            raise ValueError(f"priority must be one integer per prompt ({len(prompts)}), "
                             f"got {priority!r}"[:200])
        encoded = [self._encode(p) for p in prompts]
        processor = OutputProcessor(self.tokenizer)
        order = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(encoded, params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, sp, priority=priority[i] if priority else 0)
                processor.add_request(rid, text, ids, sp)
                order.append(rid)
            while self.engine.has_unfinished():
                self._step(processor)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        return [processor.states[rid].to_output() for rid in order]

    def _step(self, processor: OutputProcessor) -> list[SequenceDelta]:
        deltas, to_stop = processor.process(self.engine.step())
        for failed in self.engine.take_failed():  # the caller's batch fails with it
            raise ValueError(f"request {failed.request_id}: {failed.message}")
        for rid, index in to_stop:
            self.engine.abort(rid, index, stopped=True)
        return deltas

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(list(c)),
                    "prompt": self.tokenizer.apply_chat_template(list(c))}
                   for c in conversations]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt_token_ids: list[int],
               sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt (n = 1), yielding text as soon as it is decided."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() generates one sequence; use n=1")
        prompt_token_ids = _token_ids(prompt_token_ids, "prompt_token_ids")
        rid = str(next(self._ids))
        self.engine.add_request(rid, prompt_token_ids, params)
        processor = OutputProcessor(self.tokenizer)
        state = processor.add_request(rid, None, prompt_token_ids, params)
        try:
            while not state.finished and self.engine.has_unfinished():
                for delta in self._step(processor):
                    if delta.request_id == rid and delta.text:
                        yield delta.text
        finally:
            self.engine.abort(rid)

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"],
                                                        "prompt_token_ids")
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids'")
        if isinstance(prompt, list | tuple):
            return None, _token_ids(prompt, "a prompt's token ids")
        raise TypeError(f"a prompt is {_PROMPT_KINDS}, got {type(prompt).__name__}")

    @staticmethod
    def _params_list(params: SamplingParams | Sequence[SamplingParams] | None,
                     n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, list | tuple) or not all(
                isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, one "
                            f"per prompt, got {type(params).__name__} (SamplingParams(**d) "
                            "makes one of a dict)")
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params


_PROMPT_KINDS = ("a string, a list of token ids, or a dict with 'prompt' or "
                 "'prompt_token_ids'")


def _token_ids(ids, what: str) -> list[int]:
    """``ids`` as a list of integers, or a TypeError naming the first that is not one (the
    engine then checks that each is within the vocabulary)."""
    if not isinstance(ids, list | tuple):
        raise TypeError(f"{what} must be a list of integers, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(f"{what} must be integers, got {t!r} at index {i}")
    return list(ids)
