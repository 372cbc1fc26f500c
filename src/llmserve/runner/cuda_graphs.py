"""CUDA graphs of the decode step: the model's forward pass captured once per batch size.

A small model's decode step on a GPU is bound by launching its kernels (a few hundred per
step, each a few microseconds), not by the GPU. A captured graph replays all of them with
one launch. Graphs are captured at start-up for batch sizes 1, 2, 4, 8 and every multiple
of 16 up to the largest the scheduler sends (``max_num_seqs``); a decode-only step of B
sequences replays the smallest graph of at least B, with the rows past B padded:

- a padded row decodes token 0 at position 0 in a scratch block (one block past the cache's
  blocks, in no request's table): it writes its key and value there and reads only them;
- the attention metadata's tensors are the graph's static inputs (``build_graph_metadata``),
  and its grid covers every segment of the longest context captured (``MAX_CONTEXT``
  tokens at most: the attention's partials grow with it; longer contexts decode eagerly);
- each batch size has a graph per context limit the backend names
  (``graph_context_limits``): a step replays the first whose limit covers its longest
  context. With ``triton_paged``, contexts of one segment attend without the split and its
  fold (a launch less a layer, and no idle programs for the segments a short context never
  reaches); a row of one segment gets the same bits either way;
- a step's inputs go from pinned host buffers in asynchronous copies, and the next step
  waits for those copies before it writes the buffers again;
- with asynchronous scheduling, input tokens the step before sampled are copied on the
  device from its sampled ids into the graph's input before the replay;
- the output head is part of the graph (``LOGITS``): the step's float32 logits land in one
  static buffer that every bucket shares, so that the host launches nothing between the
  replay and the sampler (the head's kernel, the cast) and the GPU runs them without a gap.
  The head's arithmetic is per row, so the logits are those of the eager path, bit for bit.

Steps with a prefill chunk or speculative drafts run eagerly (``--enforce-eager``: every
step). The same kernels run in both, with the same arithmetic per row, so a sequence's
output does not depend on whether its steps were replayed.
"""

from __future__ import annotations

import itertools
import time

import torch

from llmserve.attention import AttentionContext
from llmserve.attention.backend import BatchLayout
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.logger import get_logger

logger = get_logger(__name__)

MAX_CONTEXT = 16384  # the longest context a captured decode step serves
# Whether the graphs compute the logits (read at capture; benchmarks switch it to compare).
LOGITS = True
# Whether each batch size gets a graph per context limit of the backend's, or only one for
# the longest context (read at capture; benchmarks switch it to compare).
CONTEXT_LIMITS = True


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16 up to ``max_batch`` (itself
    included)."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch}
    sizes |= set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


class DecodeGraphs:
    """The captured graphs of one runner and their static inputs."""

    def __init__(self, runner, max_batch: int, max_seq_len: int, scratch_slot: int) -> None:
        """``runner``: a ``ModelRunner`` whose attention backend builds graph metadata;
        ``scratch_slot``: the first slot of a block outside every block table (padded rows
        work there)."""
        self.runner = runner
        self.buckets = batch_buckets(max_batch)
        self.max_seq_len = max_seq_len
        self.scratch_slot = scratch_slot
        dev = runner.device
        groups = runner.num_groups
        width = -(-max_seq_len // runner.block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.full((groups, max_batch), scratch_slot, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(groups, max_batch, width, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        # Asynchronous scheduling: (row, row of the step before) of each input token the
        # step before sampled and the host has not read.
        self.fill_rows = torch.zeros(max_batch, 2, dtype=torch.int64, device=dev)
        # Pinned host copies: each step's inputs go over in asynchronous copies (the block
        # tables flat, so that a step's rows are one contiguous source).
        self._host = {name: torch.empty_like(t, device="cpu").pin_memory()
                      for name, t in self._static().items()}
        self._host["tables"] = self._host["tables"].view(-1)
        self._copied = torch.cuda.Event()  # recorded after a step's copies
        self.logits: torch.Tensor | None = None  # [max_batch, vocab] float32, with LOGITS
        # (batch size, context limit) -> (graph, its hidden states, its attention context)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                                  object]] = {}
        limits = getattr(runner.backend, "graph_context_limits", None)
        self.context_limits = (limits(max_seq_len) if limits is not None and CONTEXT_LIMITS
                               else [max_seq_len])
        self.capture_seconds = 0.0
        self.replays = 0  # steps served by a graph (tests, metrics)
        self.replays_by_limit = dict.fromkeys(self.context_limits, 0)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def graph(self, size: int, max_context: int) -> torch.cuda.CUDAGraph:
        """The graph a decode step of ``size`` rows, the longest with ``max_context`` keys,
        replays."""
        return self._graphs[self._key(size, max_context)][0]

    def _key(self, size: int, max_context: int) -> tuple[int, int]:
        """(bucket, context limit) of a step: the smallest of each that holds it."""
        return (next(b for b in self.buckets if b >= size),
                next(c for c in self.context_limits if c >= max_context))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket and context limit, largest first (the smaller
        ones reuse its memory pool)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        model = self.runner.model
        rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        for size, limit in itertools.product(reversed(self.buckets),
                                             reversed(self.context_limits)):
            ctx = self._context(size, limit)
            ids, positions = self.input_ids[:size], self.positions[:size]
            for _ in range(2):  # compiles the kernels; settles the allocator
                hidden = model(ids, positions, ctx)
                if LOGITS:
                    if self.logits is None:  # the largest bucket's: the vocabulary is known
                        vocab = model.compute_logits(hidden[:1]).shape[1]
                        self.logits = hidden.new_empty(self.max_batch, vocab,
                                                       dtype=torch.float32)
                    model.compute_logits(hidden, out=self.logits[:size])
            torch.cuda.synchronize(self.runner.device)
            for rotary in rotaries:  # its per-step tables must be looked up inside the graph
                rotary.forget_step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = model(ids, positions, ctx)
                if LOGITS:
                    model.compute_logits(hidden, out=self.logits[:size])
            self._graphs[size, limit] = (graph, hidden, ctx)  # ctx: keeps the metadata alive
        torch.cuda.synchronize(self.runner.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured CUDA graphs of the decode step for %d batch sizes (1 to %d) and "
                    "contexts up to %s keys in %.1f s", len(self.buckets), self.max_batch,
                    " and ".join(map(str, self.context_limits)), self.capture_seconds)

    def fits(self, query_lens: list[int], seq_lens: list[int], table_width: int) -> bool:
        """Whether a step replays: decodes only, at most ``max_batch`` of them, each within
        the captured context and block-table width."""
        return (0 < len(query_lens) <= self.max_batch and all(n == 1 for n in query_lens)
                and max(seq_lens) <= self.max_seq_len
                and table_width <= self.tables.shape[2])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor, seq_lens: list[int],
            fill: tuple[list[tuple[int, int]], torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [B, hidden] and, with ``LOGITS`` at capture, float32 logits
        [B, vocab] (else None) of a decode step: ``input_ids``, ``positions`` [B],
        ``slots`` [G, B], ``tables`` [G, B, width] (host or device tensors). ``fill``: the
        (row, row of the step before) of input tokens to take from the step before's
        sampled ids (a device tensor), in place of the placeholders in ``input_ids``."""
        size = len(seq_lens)
        bucket, limit = self._key(size, max(seq_lens))
        graph, hidden, _ = self._graphs[bucket, limit]
        groups, _, width = tables.shape
        self._copied.synchronize()  # the last step's copies have read the host buffers
        host = self._host
        host["input_ids"][:size] = input_ids
        host["positions"][:size] = positions
        host["slots"][:, :size] = slots
        host["seq_lens"][:size] = torch.tensor(seq_lens, dtype=torch.int32)
        rows = host["tables"][:groups * size * width].view(groups, size, width)
        rows.copy_(tables)
        if bucket > size:  # padded rows: token 0 at position 0 in the scratch block
            host["input_ids"][size:bucket] = 0
            host["positions"][size:bucket] = 0
            host["slots"][:, size:bucket] = self.scratch_slot
            host["seq_lens"][size:bucket] = 1
            self.tables[:, size:bucket, 0] = self.scratch_slot // self.runner.block_size
        static = self._static()
        for name in ("input_ids", "positions", "seq_lens"):
            static[name][:bucket].copy_(host[name][:bucket], non_blocking=True)
        self.slots[:, :bucket].copy_(host["slots"][:, :bucket], non_blocking=True)
        self.tables[:, :size, :width].copy_(rows, non_blocking=True)
        if fill is not None:
            pending, sampled = fill
            n = len(pending)
            host["fill_rows"][:n] = torch.tensor(pending, dtype=torch.int64)
            self.fill_rows[:n].copy_(host["fill_rows"][:n], non_blocking=True)  # contiguous
            self.input_ids.index_copy_(0, self.fill_rows[:n, 0],
                                       sampled.index_select(0, self.fill_rows[:n, 1]))
        self._copied.record()
        graph.replay()
        self.replays += 1
        self.replays_by_limit[limit] += 1
        return hidden[:size], None if self.logits is None else self.logits[:size]

    def _static(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions, "slots": self.slots,
                "tables": self.tables, "seq_lens": self.seq_lens, "fill_rows": self.fill_rows}

    def _context(self, size: int, limit: int) -> AttentionContext:
        runner = self.runner
        backend = runner.backend
        # Query and sequence lengths as lists are placeholders (one query each): the
        # kernels read the static tensors.
        layouts = [BatchLayout(self.slots[g, :size], self.tables[g, :size],
                               self.positions[:size], [1] * size, [1] * size,
                               runner.block_size) for g in range(runner.num_groups)]
        first = backend.build_graph_metadata(layouts[0], self.seq_lens[:size], limit)
        metadata = [first] + [backend.rebind(first, layout) for layout in layouts[1:]]
        return AttentionContext(backend, [metadata[g] for g in runner.layer_group],
                                runner.kv_caches)
