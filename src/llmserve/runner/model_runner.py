"""Runs the model on the scheduler's step: builds the flattened batch, owns the KV tensors.

One forward pass covers every scheduled token of every request (prefill chunks and decodes
together); logits are computed only at the rows that sample.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention import AttentionContext, get_attention_backend
from llmserve.attention.backend import BatchLayout
from llmserve.models.arch_config import ArchConfig
from llmserve.sample import Sampler
from llmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: ArchConfig, *, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", kv_dtype: torch.dtype = torch.float32,
                 attention_backend: str = "torch_paged", seed: int = 0) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = get_attention_backend(attention_backend)
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # Zeroed, so that padded reads of never-written slots stay finite.
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype, device=self.device),
             torch.zeros(shape, dtype=kv_dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self._seed_source = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids:
            self._generators.pop(rid, None)
        if sched.is_empty:
            return ModelRunnerOutput()
        logits = self.forward_logits(sched)  # [N, vocab]
        sampling = [s for s in sched.scheduled if s.sample]
        if not sampling:
            return ModelRunnerOutput()
        tokens = self.sampler(logits, [s.sampling_params for s in sampling],
                              [None if s.sampling_params.greedy
                               else self._generator(s.request_id, s.sampling_params.seed)
                               for s in sampling])
        return ModelRunnerOutput({s.request_id: t for s, t in zip(sampling, tokens)})

    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run the step's forward pass (writing its KV); logits [N, vocab] float32 for the
        N scheduled requests that sample, in schedule order."""
        input_ids, layout, logits_rows = self._prepare(sched)
        ctx = AttentionContext(self.backend, self.backend.build_metadata(layout), self.kv_caches)
        hidden = self.model(input_ids, layout.positions, ctx)  # [T, hidden]
        return self.model.compute_logits(hidden[logits_rows])

    def _prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, BatchLayout, torch.Tensor]:
        """Flatten the step: token ids, positions, slot mapping, padded block tables."""
        items = sched.scheduled
        query_lens = [s.num_tokens for s in items]
        seq_lens = [s.start_pos + s.num_tokens for s in items]
        max_blocks = max(len(s.block_ids) for s in items)
        tables = torch.zeros(len(items), max_blocks, dtype=torch.int64)
        for row, s in enumerate(items):
            tables[row, :len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int64)
        input_ids = torch.tensor([t for s in items for t in s.token_ids], dtype=torch.int64)
        positions = torch.cat([torch.arange(s.start_pos, s.start_pos + s.num_tokens)
                               for s in items])
        seq_of_token = torch.repeat_interleave(torch.arange(len(items)),
                                               torch.tensor(query_lens))
        slots = (tables[seq_of_token, positions // self.block_size] * self.block_size
                 + positions % self.block_size)
        ends = torch.cumsum(torch.tensor(query_lens), 0) - 1
        logits_rows = ends[torch.tensor([s.sample for s in items])]
        dev = self.device
        layout = BatchLayout(slot_mapping=slots.to(dev), block_tables=tables.to(dev),
                             positions=positions.to(dev), query_lens=query_lens,
                             seq_lens=seq_lens, block_size=self.block_size)
        return input_ids.to(dev), layout, logits_rows.to(dev)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request_id] = gen
        return gen
