"""EngineCore: the loop of schedule, execute, update over one model and its KV cache."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llmserve.config import EngineConfig
from llmserve.engine.request import Request
from llmserve.kv_cache import KVCacheManager, KVCacheSpec, num_blocks_for_memory
from llmserve.kv_cache.sizing import default_kv_cache_memory_gib, describe_capacity
from llmserve.logger import get_logger
from llmserve.models.loader import LoadedModel, load_model
from llmserve.runner import ModelRunner
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import Scheduler, SchedulerStats

logger = get_logger(__name__)


class ContextLengthError(ValueError):
    """A prompt, or a prompt plus max_tokens, does not fit the context window."""


@dataclass
class EngineCoreOutput:
    """What one step produced for one request; plain data for the frontend."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        torch.manual_seed(config.seed)
        self.loaded = loaded or load_model(config.model.model, config.model.device)
        arch = self.loaded.arch_config
        self.tokenizer = self.loaded.tokenizer

        cache = config.cache
        spec = KVCacheSpec(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                           cache.block_size, dtype_bytes=4)
        num_blocks = cache.num_blocks or num_blocks_for_memory(
            spec, cache.kv_cache_memory_gib or default_kv_cache_memory_gib())
        self.max_model_len = self._resolve_max_model_len(num_blocks * cache.block_size)
        logger.info(describe_capacity(spec, num_blocks, self.max_model_len))

        self.kv_manager = KVCacheManager(num_blocks, cache.block_size,
                                         cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.runner = ModelRunner(self.loaded.model, arch, num_blocks=num_blocks,
                                  block_size=cache.block_size, device=config.model.device,
                                  seed=config.seed)
        self.eos_token_ids = self.tokenizer.stop_token_ids | frozenset(arch.eos_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0) -> Request:
        """Validate against the context window and queue the request."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: it must contain at least one token")
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {n} tokens, the context window is {self.max_model_len}: "
                "no room left to generate")
        room = self.max_model_len - n
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ContextLengthError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                f"window of {self.max_model_len} tokens; lower max_tokens to at most {room}")
        vocab = self.loaded.arch_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        request = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                          max_tokens=max_tokens, priority=priority)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        changed = self.scheduler.update(sched, result)
        return [EngineCoreOutput(r.request_id, [r.output_token_ids[-1]], r.status.finish_reason,
                                 r.stop_reason, r.num_prompt_tokens, r.num_cached_tokens)
                for r in changed]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def _resolve_max_model_len(self, kv_capacity_tokens: int) -> int:
        native = self.loaded.arch_config.max_position_embeddings
        asked = self.config.model.max_model_len
        if asked is not None and asked > native:
            raise ValueError(f"max_model_len {asked} exceeds the model's context length {native}")
        length = asked or native
        if length > kv_capacity_tokens:
            if asked is not None:
                raise ValueError(f"max_model_len {asked} does not fit in the KV cache "
                                 f"({kv_capacity_tokens} tokens); raise --kv-cache-memory")
            logger.warning("context window capped to the KV cache capacity: %d tokens "
                           "(the model allows %d)", kv_capacity_tokens, native)
            length = kv_capacity_tokens
        return length
