"""Runs the model on the scheduler's step: builds the flattened batch, owns the KV tensors.

One forward pass covers every scheduled token of every request (prefill chunks and decodes
together); logits are computed only at the rows that sample.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention import AttentionContext, get_attention_backend
from llmserve.attention.backend import BatchLayout
from llmserve.attention.kv_format import PagedKVCache
from llmserve.models.arch_config import ArchConfig
from llmserve.sample import Sampler
from llmserve.sample.ops import topk_logprobs
from llmserve.sample.sampler import SamplingRow
from llmserve.scheduler.output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: ArchConfig, *, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", kv_cache_dtype: str = "float32",
                 attention_backend: str = "auto", seed: int = 0,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = get_attention_backend(attention_backend, self.device, block_size)
        self.kv_caches = [
            PagedKVCache.allocate(kv_cache_dtype, num_blocks, block_size,
                                  cfg.num_key_value_heads, cfg.head_dim, self.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        self._generators: dict[str, torch.Generator] = {}
        self._seed_source = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids:
            self._generators.pop(rid, None)
        if sched.is_empty:
            return ModelRunnerOutput()
        hidden, ends = self._forward(sched)
        out = ModelRunnerOutput()
        sampling = [(i, s) for i, s in enumerate(sched.scheduled) if s.sample]
        if sampling:
            logits = self.model.compute_logits(hidden[ends[[i for i, _ in sampling]]])
            rows = [self._sampling_row(s) for _, s in sampling]
            result = self.sampler(logits, rows)
            for (_, s), token, lp in zip(sampling, result.token_ids, result.logprobs):
                out.sampled_token_ids[s.request_id] = token
                if lp is not None:
                    out.logprobs[s.request_id] = lp
        for i, s in enumerate(sched.scheduled):
            if s.sampling_params.prompt_logprobs is not None:
                entry = self._prompt_logprobs(hidden, int(ends[i]), s)
                if entry is not None:
                    out.prompt_logprobs[s.request_id] = entry
        return out

    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run the step's forward pass (writing its KV); logits [N, vocab] float32 for the
        N scheduled requests that sample, in schedule order."""
        hidden, ends = self._forward(sched)
        rows = [i for i, s in enumerate(sched.scheduled) if s.sample]
        return self.model.compute_logits(hidden[ends[rows]])

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, hidden] of every scheduled token; ends [B]: row of each request's
        last token."""
        input_ids, layout = self._prepare(sched)
        ctx = AttentionContext(self.backend, self.backend.build_metadata(layout), self.kv_caches)
        hidden = self.model(input_ids, layout.positions, ctx)
        ends = torch.cumsum(torch.tensor(layout.query_lens), 0) - 1
        return hidden, ends.to(hidden.device)

    def _sampling_row(self, s: ScheduledRequest) -> SamplingRow:
        params = s.sampling_params
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        generator = None if params.greedy else self._generator(s.request_id, params.seed)
        return SamplingRow(params, generator, s.prompt_token_ids, s.output_token_ids, stop_ids)

    def _prompt_logprobs(self, hidden: torch.Tensor, end: int,
                         s: ScheduledRequest) -> tuple[int, list[TokenLogprobs]] | None:
        """Logprobs of the prompt tokens this chunk predicts: position p predicts p + 1."""
        first_target = s.start_pos + 1
        last_target = min(s.start_pos + s.num_tokens, len(s.prompt_token_ids) - 1)
        if last_target < first_target:
            return None
        count = last_target - first_target + 1
        start_row = end - s.num_tokens + 1
        logits = self.model.compute_logits(hidden[start_row:start_row + count])
        targets = torch.tensor(s.prompt_token_ids[first_target:last_target + 1],
                               device=logits.device)
        ids, lps, ranks = topk_logprobs(logits.log_softmax(dim=1), targets,
                                        s.sampling_params.prompt_logprobs)
        return first_target, list(zip(ids.tolist(), lps.tolist(), ranks.tolist()))

    def _prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, BatchLayout]:
        """Flatten the step: token ids, positions, slot mapping, padded block tables."""
        items = sched.scheduled
        query_lens = [s.num_tokens for s in items]
        seq_lens = [s.start_pos + s.num_tokens for s in items]
        max_blocks = max(len(s.block_ids) for s in items)
        tables = torch.tensor([s.block_ids + [0] * (max_blocks - len(s.block_ids))
                               for s in items], dtype=torch.int64)  # [B, max_blocks]
        input_ids = torch.tensor([t for s in items for t in s.token_ids], dtype=torch.int64)
        positions = torch.cat([torch.arange(s.start_pos, s.start_pos + s.num_tokens)
                               for s in items])
        seq_of_token = torch.repeat_interleave(torch.arange(len(items)),
                                               torch.tensor(query_lens))
        slots = (tables[seq_of_token, positions // self.block_size] * self.block_size
                 + positions % self.block_size)
        dev = self.device
        layout = BatchLayout(slot_mapping=slots.to(dev), block_tables=tables.to(dev),
                             positions=positions.to(dev), query_lens=query_lens,
                             seq_lens=seq_lens, block_size=self.block_size)
        return input_ids.to(dev), layout

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request_id] = gen
        return gen
