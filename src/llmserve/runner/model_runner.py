"""Runs the model on the scheduler's step: builds the flattened batch, owns the KV tensors.

One forward pass covers every scheduled token of every request (prefill chunks and decodes
together); logits are computed only at the rows that sample.

Speculative decoding is verified in the same pass: a request with k draft tokens samples at
k + 1 rows (its last known token and each draft), each row with the tokens before it as its
history, and emits the samples up to and including the first that differs from the draft
it checks. Every sampled token draws its randomness with its own key, made of the
request's seed and the token's position in the sequence (``token_seed``), so a row samples
exactly what it would have sampled without speculation: the output is the same token for
token (greedy or seeded), and accepting a proposal only when the target's own sample equals
it is the rejection rule for a deterministic proposal (accepted with probability p(draft);
on rejection the target's sample, which is then distributed as p without the draft,
renormalised).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from llmserve.attention import AttentionContext, get_attention_backend
from llmserve.attention.backend import BatchLayout
from llmserve.models.arch_config import ArchConfig
from llmserve.runner.cuda_graphs import DecodeGraphs
from llmserve.sample import Sampler
from llmserve.sample.ops import apply_token_bitmask, to_device, topk_logprobs
from llmserve.sample.sampler import SamplingRow
from llmserve.scheduler.output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from llmserve.structured_output import GrammarBackend


class StepHandle:
    """A launched step: ``token_ids`` its sampled ids on the device, one per sampling row in
    schedule order (None if it samples nothing); ``result()`` its output (waits for it)."""

    def __init__(self, token_ids: torch.Tensor | None,
                 finish: Callable[[], ModelRunnerOutput]) -> None:
        self.token_ids = token_ids
        self._finish: Callable[[], ModelRunnerOutput] | None = finish
        self._out: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._finish is not None:
            self._out, self._finish = self._finish(), None
        assert self._out is not None
        return self._out


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: ArchConfig, *, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", kv_cache_dtype: str = "float32",
                 attention_backend: str = "auto", seed: int = 0,
                 eos_token_ids: frozenset[int] = frozenset(),
                 kv_groups: Sequence[Sequence[int]] | None = None) -> None:
        """``kv_groups``: the layers of each KV cache group, every group as many (None: one
        group of every layer); a request's ``block_ids`` hold one table per group."""
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = get_attention_backend(attention_backend, self.device, block_size)
        groups = [list(g) for g in kv_groups or [range(cfg.num_hidden_layers)]]
        layers = sorted(layer for g in groups for layer in g)
        if len({len(g) for g in groups}) != 1 or layers != list(range(cfg.num_hidden_layers)):
            raise ValueError(f"kv_groups must split the {cfg.num_hidden_layers} layers into "
                             f"groups of one size, got {groups}")
        # Layer j of every group stores its KV in the j-th tensor, at the group's block ids.
        # On a GPU one block more (also when no graph is captured): the scratch block that
        # padded CUDA-graph rows work in. ``num_blocks`` stays the allocator's count.
        self.num_blocks = num_blocks
        extra = 1 if self.device.type == "cuda" else 0
        tensors = [self.backend.allocate_kv_cache(kv_cache_dtype, num_blocks + extra, block_size,
                                                  cfg.num_key_value_heads, cfg.head_dim,
                                                  self.device)
                   for _ in groups[0]]
        self.num_groups = len(groups)
        self.layer_group = [0] * cfg.num_hidden_layers
        self.kv_caches = [tensors[0]] * cfg.num_hidden_layers
        for g, layers in enumerate(groups):
            for j, layer in enumerate(layers):
                self.layer_group[layer] = g
                self.kv_caches[layer] = tensors[j]
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        # Masks of requests with structured outputs (set by the engine; none for drafts).
        self.grammar: GrammarBackend | None = None
        self._seeds: dict[str, int] = {}  # per request: the base of its tokens' seeds
        self._seed_source = torch.Generator().manual_seed(seed)
        self.graphs: DecodeGraphs | None = None  # see capture_cuda_graphs

    def capture_cuda_graphs(self, max_batch: int, max_seq_len: int) -> DecodeGraphs:
        """Capture the decode step for batches up to ``max_batch`` and contexts up to
        ``max_seq_len`` (``runner/cuda_graphs.py``); later decode-only steps replay them."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        if not hasattr(self.backend, "build_graph_metadata"):
            raise ValueError(f"the {self.backend.name} attention backend cannot be captured "
                             "in a CUDA graph; use triton_paged or --enforce-eager")
        graphs = DecodeGraphs(self, max_batch, max_seq_len, self.num_blocks * self.block_size)
        graphs.capture()
        self.graphs = graphs
        return graphs

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step and return what it sampled."""
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        """Start the step; its sampled tokens are read when the handle's ``result()`` is
        called. A decode step replayed by a CUDA graph does not wait for the device here (an
        eager step's input copies and prompt logprobs do), so the host can plan and launch
        the next step meanwhile. ``prev``: the step before, whose sampled ids feed this
        step's ``input_from_row`` tokens."""
        for rid in sched.finished_req_ids:
            self._seeds.pop(rid, None)
        if self.grammar is not None:
            for rid in sched.finished_req_ids:
                self.grammar.free(rid)
        if sched.is_empty:
            return StepHandle(None, ModelRunnerOutput)
        sampling = [(i, s) for i, s in enumerate(sched.scheduled) if s.sample]
        constrained = [s for _, s in sampling if s.sampling_params.structured_outputs]
        masks = None
        if constrained:
            assert self.grammar is not None, "structured outputs need a GrammarBackend"
            masks = self.grammar.submit(constrained)  # computed while the model runs
        hidden, ends, graph_logits = self._forward(sched, prev)
        out = ModelRunnerOutput()
        for i, s in enumerate(sched.scheduled):
            if s.sampling_params.prompt_logprobs is not None:
                entry = self._prompt_logprobs(hidden, ends[i], s)
                if entry is not None:
                    out.prompt_logprobs[s.request_id] = entry
        if not sampling:
            return StepHandle(None, lambda: out)
        # k + 1 rows per request with k drafts: its last known token, then each draft.
        row_ids = [ends[i] - s.num_draft_tokens + j
                   for i, s in sampling for j in range(s.num_draft_tokens + 1)]
        # When every row samples (decodes, verification rows) they are in order: no gather,
        # and a replayed decode step has computed their logits already.
        if len(row_ids) < hidden.shape[0]:
            logits = self.model.compute_logits(hidden[row_ids])
        elif graph_logits is not None:
            logits = graph_logits
        else:
            logits = self.model.compute_logits(hidden)
        if masks is not None:
            logits = apply_token_bitmask(logits, self._constrained_rows(sampling),
                                         masks.result())
        if all(s.sampling_params.plain_greedy for _, s in sampling):
            pending = self.sampler.launch_greedy(logits)  # no rows to build (many decodes)
        else:
            rows = [self._sampling_row(s, j) for _, s in sampling
                    for j in range(s.num_draft_tokens + 1)]
            pending = self.sampler.launch(logits, rows)

        def finish() -> ModelRunnerOutput:
            result = pending.result()
            token_ids = result.token_ids
            first = 0
            for _, s in sampling:
                k = s.num_draft_tokens
                emitted = (accepted_prefix(token_ids[first:first + k + 1], s.draft_token_ids)
                           if k else [token_ids[first]])
                out.sampled_token_ids[s.request_id] = emitted
                if s.sampling_params.structured_outputs is not None:
                    self.grammar.accept(s.request_id, emitted)
                if s.sampling_params.logprobs is not None:
                    out.logprobs[s.request_id] = result.logprobs[first:first + len(emitted)]
                first += k + 1
            return out

        return StepHandle(pending.token_ids, finish)

    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run the step's forward pass (writing its KV); logits float32 [N, vocab] for the
        requests that sample, in schedule order: ``num_draft_tokens + 1`` rows each (the
        last known token and each proposal after it; one row without proposals)."""
        hidden, ends, _ = self._forward(sched)
        rows = [ends[i] - s.num_draft_tokens + j for i, s in enumerate(sched.scheduled)
                if s.sample for j in range(s.num_draft_tokens + 1)]
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def write_kv(self, sched: SchedulerOutput) -> None:
        """Run the step's forward pass for its KV alone (no logits, nothing sampled)."""
        self._forward(sched)

    def time_verify_step(self, num_tokens: int, block_ids: list[int], repeats: int = 3) -> float:
        """Seconds of a step that verifies ``num_tokens - 1`` drafts of one request (every
        row computes logits and samples greedily); best of ``repeats``. The blocks must be
        held for the duration (they are written)."""
        from llmserve.sampling_params import SamplingParams

        item = ScheduledRequest("__timing__", [0] * num_tokens, 0,
                                [block_ids] * self.num_groups, True,
                                SamplingParams(temperature=0, max_tokens=1),
                                num_draft_tokens=num_tokens - 1)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self.execute(SchedulerOutput([item]))
            best = min(best, time.perf_counter() - start)
        return best

    def _forward(self, sched: SchedulerOutput, prev: StepHandle | None = None
                 ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Hidden states [T, hidden] of every scheduled token; ends [B]: row of each
        request's last token; float32 logits of every row when a CUDA graph computed them
        (a decode step replayed), else None."""
        items = sched.scheduled
        query_lens = [s.num_tokens for s in items]
        seq_lens = [s.start_pos + s.num_tokens for s in items]
        input_ids, positions, tables, slots = self._prepare(sched)
        # Tokens the step before sampled and the host has not read: (row here, row there).
        pending = [(row, s.input_from_row) for row, s in
                   zip(itertools.accumulate(query_lens, initial=0), items)
                   if s.input_from_row is not None]
        if pending and (prev is None or prev.token_ids is None):
            raise ValueError("a step with pending input tokens needs the step before's handle")
        fill = (pending, prev.token_ids) if pending else None
        if self.graphs is not None and self.graphs.fits(query_lens, seq_lens, tables.shape[2]):
            hidden, logits = self.graphs.run(input_ids, positions, slots, tables, seq_lens,
                                             fill)
            return hidden, list(range(len(items))), logits
        dev = self.device
        input_ids, positions, tables, slots = (input_ids.to(dev), positions.to(dev),
                                               tables.to(dev), slots.to(dev))
        if fill is not None:
            dst, src = (to_device(dev, rows, torch.int64) for rows in zip(*pending))
            input_ids[dst] = prev.token_ids[src]
        layouts = [BatchLayout(slot_mapping=slots[g], block_tables=tables[g],
                               positions=positions, query_lens=query_lens, seq_lens=seq_lens,
                               block_size=self.block_size) for g in range(self.num_groups)]
        metadata = [self.backend.build_metadata(layouts[0])]
        metadata += [self.backend.rebind(metadata[0], layout) for layout in layouts[1:]]
        ctx = AttentionContext(self.backend, [metadata[g] for g in self.layer_group],
                               self.kv_caches)
        layout = layouts[0]
        hidden = self.model(input_ids, layout.positions, ctx)
        return hidden, [end - 1 for end in itertools.accumulate(query_lens)], None

    @staticmethod
    def _constrained_rows(sampling: list[tuple[int, ScheduledRequest]]) -> torch.Tensor:
        """Logits rows of the requests with structured outputs, in order."""
        rows, first = [], 0
        for _, s in sampling:
            if s.sampling_params.structured_outputs is not None:
                rows.extend(range(first, first + s.num_draft_tokens + 1))
            first += s.num_draft_tokens + 1
        return torch.tensor(rows, dtype=torch.int64)

    def _sampling_row(self, s: ScheduledRequest, j: int) -> SamplingRow:
        """Row ``j`` of a request's k + 1: the drafts before it count as generated."""
        params = s.sampling_params
        stop_ids: frozenset[int] = frozenset()  # read for min_tokens only
        if params.min_tokens:
            stop_ids = frozenset(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids |= self.eos_token_ids
        output = s.output_token_ids + s.draft_token_ids[:j] if j else s.output_token_ids
        seed = None
        if not params.greedy:
            position = s.start_pos + s.num_tokens - s.num_draft_tokens + j  # of the sample
            seed = token_seed(self._request_seed(s.request_id, params.seed), position)
        return SamplingRow(params, seed, s.prompt_token_ids, output, stop_ids)

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

    def _prepare(self, sched: SchedulerOutput
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flatten the step on the host: token ids [T], positions [T], and per KV cache
        group the padded block tables [G, B, max_blocks] and slot mapping [G, T]."""
        items = sched.scheduled
        groups = range(self.num_groups)
        max_blocks = max(len(s.block_ids[g]) for s in items for g in groups)
        pad = [0] * max_blocks
        flat: list[int] = []
        for g in groups:
            for s in items:
                ids = s.block_ids[g]
                flat += ids
                flat += pad[len(ids):]
        tables = int64_tensor(flat).view(self.num_groups, len(items), max_blocks)
        if all(s.num_tokens == 1 for s in items):  # decodes: a few small lists, one tensor
            bs = self.block_size
            positions = [s.start_pos for s in items]
            rows = [[s.token_ids[0] for s in items], positions]
            rows += [[s.block_ids[g][p // bs] * bs + p % bs for s, p in zip(items, positions)]
                     for g in groups]
            flat_rows = int64_tensor(rows)
            return flat_rows[0], flat_rows[1], tables, flat_rows[2:]
        query_lens = [s.num_tokens for s in items]
        input_ids = int64_tensor([t for s in items for t in s.token_ids])
        positions = torch.cat([torch.arange(s.start_pos, s.start_pos + s.num_tokens)
                               for s in items])
        seq_of_token = torch.repeat_interleave(torch.arange(len(items)),
                                               torch.tensor(query_lens))
        slots = (tables[:, seq_of_token, positions // self.block_size] * self.block_size
                 + positions % self.block_size)  # [G, T]
        return input_ids, positions, tables, slots

    def _request_seed(self, request_id: str, seed: int | None) -> int:
        """The request's base seed: its own, or one drawn for it on its first sample. With
        the position it keys each token's draw: the same whatever the batch, the step it
        falls in, or the drafts verified around it."""
        base = self._seeds.get(request_id)
        if base is None:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            base = self._seeds[request_id] = seed
        return base


def int64_tensor(values: list) -> torch.Tensor:
    """A host int64 tensor of a (nested) list of ints, through numpy: ~3x faster than
    ``torch.tensor`` for the step's block tables and token lists."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def token_seed(base: int, position: int) -> int:
    """splitmix64 of (seed, position): the key of the token sampled at ``position``,
    independent for neighbouring positions."""
    x = (base * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1  # manual_seed takes a non-negative 63-bit value


def accepted_prefix(samples: list[int], drafts: list[int]) -> list[int]:
    """The target's samples up to and including the first that differs from its draft (all
    k + 1 when every draft is accepted: the last one is the bonus token)."""
    for j, draft in enumerate(drafts):
        if samples[j] != draft:
            return samples[:j + 1]
    return samples[:len(drafts) + 1]
