"""The draft-model proposer: a smaller model with the target's vocabulary proposes greedily.

The draft runs on the same engine code as the target (a ``ModelRunner`` with its own paged
KV cache and its own block table per request, so the target's block accounting never sees
it). Per request it remembers how many tokens of the history its cache holds. Each call
runs up to ``k`` passes, all requests batched in each: the first takes the tokens the target
emitted since the last proposal (the bonus token, a draft the last pass did not write, the
tokens of steps that did not speculate) with the last known token, and proposes from its
last row; the others take one token each.

Each pass also carries, after a request's token, what a prompt lookup over its history and
proposal so far expects to follow (``draft_prompt_lookup``, on by default): the row of each
guess gives the draft's own next token after it, as a pass of its own would, so every guess
the draft confirms saves one pass (text copied from the prompt: quotes, code, names). The
proposals are the same as without; a refuted guess costs its row.

A longer history not yet in the cache (the prompt, the first time) is written before, in
passes of the engine's token budget: the request's prefill in the draft, paid once, which is
why the Speculator engages a draft model only where speculation promises much (one user on
an idle server), and for a request it has not followed yet only if the tokens the request is
expected to add pay that prefill back (``catch_up_seconds``, planner.catch_up_pays). A
proposal that the target then accepts is already in the draft's cache: the next call starts
after it.

A draft that is the target's own model in another weight format (the int4 copy drafting for
float32), or its first layers, computes no history at all (``draft_kv_from_target``): the
target's cache holds the keys and values of every token but a decoding request's last, for
the same layers of the same model, computed from better weights. The blocks that hold them
are copied into the draft's cache as they are (which then takes the target's format)
instead: no prefill of the prompt in the draft, and the first pass carries the last token
only. This is the KV sharing of quantized
self-speculation (QSpec); the proposals change, the verification and so the output do not.

Proposals are greedy, so each is deterministic given the history, and the target's rule
for deterministic proposals (keep a draft while the target's own sample equals it) is exact
in distribution; see ``runner/model_runner.py``.

A request whose draft blocks cannot be had gets no proposal this step (and the target runs
as without speculation); its cache is kept for later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.attention.kv_format import (
    PagedKVCache,
    as_int,
    kv_bytes_per_vector,
    resolve_kv_cache_dtype,
)
from llmserve.config import EngineConfig, SpeculativeConfig
from llmserve.engine.request import Request
from llmserve.errors import ModelLoadError
from llmserve.logger import get_logger
from llmserve.models.loader import LoadedModel, load_model
from llmserve.runner import ModelRunner
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import ScheduledRequest, SchedulerOutput
from llmserve.spec_decode.ngram import NgramProposer, ngram_propose

logger = get_logger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class _DraftSequence:
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # history tokens whose KV the draft cache holds
    proposed: list[int] = field(default_factory=list)  # the last proposal, KV held for all
    # but its last token (positions num_computed ...)


@dataclass
class TargetKV:
    """The target's KV cache, for a draft of the same model to read histories from."""

    caches: Sequence[object]  # per target layer (a PagedKVCache where it can be read)
    dtype: str  # their format (the draft's cache takes it)
    block_table: Callable[[str], list[int]]  # a request's blocks (its first KV group's)
    num_groups: int = 1  # KV cache groups (sliding-window layers have their own)
    max_model_len: int = 0  # the longest context a request may reach


class DraftProposer:
    cheap = False  # a model runs: plan first, then propose only what the plan uses

    def __init__(self, config: SpeculativeConfig, *, target: LoadedModel,
                 engine_config: EngineConfig, num_blocks: int,
                 draft: LoadedModel | None = None,
                 target_kv: TargetKV | None = None) -> None:
        mc = engine_config.model
        self.loaded = draft or _load_draft(config, engine_config)
        arch, target_arch = self.loaded.arch_config, target.arch_config
        if arch.vocab_size != target_arch.vocab_size:
            raise ModelLoadError(f"draft model {config.model}: vocabulary of "
                                 f"{arch.vocab_size} tokens, the target's has "
                                 f"{target_arch.vocab_size}; a draft must share the "
                                 "target's tokenizer")
        self.block_size = engine_config.cache.block_size
        self.budget = engine_config.scheduler.max_num_batched_tokens
        why_not = _why_not_target_kv(self.loaded, target, target_kv)
        if config.draft_kv_from_target and why_not:
            raise ModelLoadError(f"draft_kv_from_target: {why_not}")
        self.target_kv = target_kv if config.draft_kv_from_target is not False \
            and not why_not else None
        fmt = self.loaded.weight_format
        kv_dtype = resolve_kv_cache_dtype(engine_config.cache.kv_cache_dtype, fmt.dtype,
                                          fmt.quantization, str(mc.device))
        if self.target_kv:
            # Blocks are copied as they are: the draft's cache takes the target's format,
            # in the memory its own format would have taken (fewer blocks of a wider one),
            # and never fewer than one request of the longest context needs.
            own = kv_bytes_per_vector(kv_dtype, arch.head_dim)
            kv_dtype = self.target_kv.dtype
            one = -(-(self.target_kv.max_model_len + config.num_speculative_tokens)
                    // self.block_size)
            num_blocks = min(num_blocks, max(
                one, num_blocks * own // kv_bytes_per_vector(kv_dtype, arch.head_dim)))
        self.runner = ModelRunner(self.loaded.model, arch, num_blocks=num_blocks,
                                  block_size=self.block_size, device=mc.device,
                                  kv_cache_dtype=kv_dtype)
        if self.target_kv and not all(isinstance(c, PagedKVCache)
                                      for c in self.runner.kv_caches):
            if config.draft_kv_from_target:
                raise ModelLoadError("draft_kv_from_target: the draft's KV cache is in a GPU "
                                     "backend's layout (triton_paged)")
            self.target_kv = None
        self.num_blocks = num_blocks
        self.num_speculative_tokens = config.num_speculative_tokens
        self._free = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[str, _DraftSequence] = {}
        self.lookup = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                       if config.draft_prompt_lookup is not False else None)
        self.guessed = self.guesses_kept = 0  # prompt-lookup guesses checked, confirmed
        self.step_seconds = self._time_step()
        self.last_catch_up_seconds = 0.0
        self.prefill_token_seconds = (self._time_copy() if self.target_kv
                                      else self._time_prefill())
        logger.info("draft model: %s, %d layers; a proposal step %.2f ms, a history token "
                    "%s %.3f ms", self.loaded.describe(), arch.num_hidden_layers,
                    self.step_seconds * 1e3,
                    "copied from the target's cache" if self.target_kv else "written",
                    self.prefill_token_seconds * 1e3)

    # ---- Proposer ------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[Request], counts: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        self.last_catch_up_seconds = 0.0
        active: list[tuple[int, Request, _DraftSequence]] = []
        proposing = {r.request_id for r, k in zip(requests, counts) if k > 0}
        for i, (r, k) in enumerate(zip(requests, counts)):
            if k <= 0:
                continue
            seq = self._seqs.setdefault(r.request_id, _DraftSequence())
            if self.target_kv is None:  # else the target's KV replaces the draft's own
                seq.num_computed += _kept(seq, r.all_token_ids)
            seq.proposed = []
            # KV for the history and for all but the last of the k proposals. A copying
            # draft's cache only holds copies: those of requests not proposed for now make
            # room (they are copied again when next needed).
            need = r.num_tokens + k - 1
            reserved = self._reserve(seq, need)
            if not reserved and self.target_kv is not None and self._evict(proposing):
                reserved = self._reserve(seq, need)
            if reserved:
                active.append((i, r, seq))
        if not active:
            return proposals
        # Each pass carries, after a request's next token, what a prompt lookup over its
        # history and proposal so far expects to follow: the rows of those guesses give
        # the draft's own token after each, and the guesses it confirms save a pass each.
        # The first pass starts with the rest of the history (see _catch_up).
        start = time.perf_counter()
        first = self._catch_up(active)
        self.last_catch_up_seconds = time.perf_counter() - start
        # A pass: (owner, request, draft sequence, its tokens, their first position).
        todo = [(i, r, seq, r.all_token_ids[first[r.request_id]:], first[r.request_id])
                for i, r, seq in active]
        while todo:
            guesses = self._pass_guesses(todo, counts, proposals)
            items = [ScheduledRequest(r.request_id, tokens + guess, pos, [seq.blocks], True,
                                      _GREEDY, num_draft_tokens=len(guess))
                     for (_, r, seq, tokens, pos), guess in zip(todo, guesses)]
            for (i, *_), guess, rows in zip(todo, guesses, self._argmax(items)):
                confirmed = _agreed(guess, rows)
                proposals[i] += rows[:confirmed + 1]
                self.guessed += len(guess)
                self.guesses_kept += confirmed
            todo = [(i, r, seq, proposals[i][-1:], r.num_tokens - 1 + len(proposals[i]))
                    for i, r, seq, _, _ in todo if len(proposals[i]) < counts[i]]
        # Held: the history (with the target's KV, from its own cache: the last token's is
        # the draft's and is copied again next time).
        held = 1 if self.target_kv is None else 0
        for i, r, seq in active:
            seq.num_computed = r.num_tokens - 1 + held
            seq.proposed = proposals[i]
        return proposals

    def catch_up_seconds(self, request: Request) -> float:
        """Seconds to write (or, reading the target's cache, copy) the history of a request
        the draft does not follow yet (its prompt and output so far, but what the first
        proposal pass carries: see _catch_up).
        Once it follows a request, what the draft lags after steps that did not speculate is
        written as part of proposing, and not counted here."""
        seq = self._seqs.get(request.request_id)
        if seq is not None and seq.num_computed > 0:
            return 0.0
        written = request.num_tokens - 1 if self.target_kv else self._first_pass_start(request, 0)
        return written * self.prefill_token_seconds

    def free(self, request_id: str) -> None:
        if self.lookup is not None:
            self.lookup.free(request_id)
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def reset(self) -> None:
        pass  # its KV cache holds running requests only: nothing shared to forget

    # ---- internals -----------------------------------------------------------------------

    def _time_step(self) -> float:
        """Seconds of one proposal step for one request (best of a few)."""
        blocks = self._free[-1:]
        self.runner.time_verify_step(1, blocks, repeats=2)  # first-call costs
        return self.runner.time_verify_step(1, blocks)

    def _time_copy(self, num_tokens: int = 64) -> float:
        """Seconds per token of copying a history from the target's cache (best of a few):
        the target's first blocks are read, the draft's free blocks written."""
        num_blocks = min(-(-num_tokens // self.block_size), len(self._free),
                         self.target_kv.caches[0].num_blocks)
        cuda = self.runner.device.type == "cuda"
        times = []
        for _ in range(4):
            start = time.perf_counter()
            self._copy_blocks(list(range(num_blocks)), self._free[-num_blocks:])
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        # The first copy touches the blocks' fresh pages: not counted.
        return min(times[1:]) / max(num_blocks * self.block_size, 1)

    def _copy_history(self, spans: list[tuple[Request, _DraftSequence, int, int]]) -> None:
        """Copy the target's keys and values of positions [start, end) of each request into
        the draft's cache: the whole blocks that hold them, which position for position
        are laid out alike in both caches. The other slots of those blocks are harmless:
        before ``start`` the target's own keys and values of the same tokens, from ``end``
        on slots the draft writes before it reads them."""
        bs = self.block_size
        source: list[int] = []
        target: list[int] = []
        for r, seq, start, end in spans:
            if end > start:
                table = self.target_kv.block_table(r.request_id)
                source += table[start // bs:(end - 1) // bs + 1]
                target += seq.blocks[start // bs:(end - 1) // bs + 1]
        if source:
            self._copy_blocks(source, target)

    def _copy_blocks(self, source: list[int], target: list[int]) -> None:
        """Blocks ``source`` of the target's cache into blocks ``target`` of the draft's,
        in every draft layer (both caches hold the same format)."""
        device = self.runner.kv_caches[0].key.device
        src_ids = torch.tensor(source, dtype=torch.int64, device=device)
        dst_ids = torch.tensor(target, dtype=torch.int64, device=device)
        for src, dst in zip(self.target_kv.caches, self.runner.kv_caches):
            for a, b in ((src.key, dst.key), (src.value, dst.value),
                         (src.key_scale, dst.key_scale), (src.value_scale, dst.value_scale)):
                if a is not None:  # as integers of the same width: no float8 kernels on CPU
                    as_int(b).index_copy_(0, dst_ids, as_int(a).index_select(0, src_ids))

    def _time_prefill(self, num_tokens: int = 64) -> float:
        """Seconds per token of writing a history into the draft's cache (best of a few
        passes of ``num_tokens``)."""
        num_tokens = max(min(num_tokens, len(self._free) * self.block_size), 1)
        count = -(-num_tokens // self.block_size)  # the blocks that hold them
        blocks = self._free[len(self._free) - count:]
        item = ScheduledRequest("__timing__", [0] * num_tokens, 0, [blocks], False, _GREEDY)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            self.runner.write_kv(SchedulerOutput([item], num_tokens))
            best = min(best, time.perf_counter() - start)
        return best / num_tokens

    def _argmax(self, items: list[ScheduledRequest]) -> list[list[int]]:
        """One pass over the items; each item's greedy tokens, one per row it verifies."""
        tokens = self.runner.forward_logits(
            SchedulerOutput(items, sum(s.num_tokens for s in items))).argmax(dim=-1).tolist()
        out, row = [], 0
        for s in items:
            out.append(tokens[row:row + s.num_draft_tokens + 1])
            row += s.num_draft_tokens + 1
        return out

    def _pass_guesses(self, todo: list, counts: list[int],
                      proposals: list[list[int]]) -> list[list[int]]:
        """Each request's guesses for a pass: up to what its count still needs after the
        pass's token, while the engine's token budget has room."""
        room = self.budget - sum(len(tokens) for _, _, _, tokens, _ in todo)
        out = []
        for i, r, _, _, _ in todo:
            out.append(self._guesses(r, proposals[i],
                                     min(counts[i] - len(proposals[i]) - 1, room)))
            room -= len(out[-1])
        return out

    def _guesses(self, request: Request, proposed: list[int], count: int) -> list[int]:
        """Up to ``count`` tokens a prompt lookup expects after the history and the tokens
        ``proposed`` so far."""
        if count <= 0 or self.lookup is None:
            return []
        history = self.lookup.history(request)
        if proposed:
            history = np.concatenate([history, np.asarray(proposed, dtype=history.dtype)])
        return ngram_propose(history, self.lookup.min_n, self.lookup.max_n, count)

    def _evict(self, keep: set[str]) -> bool:
        """Free the blocks of every sequence but those of ``keep`` (a copying draft: their
        histories are copied again from the target when next needed); whether any were."""
        freed = False
        for request_id, seq in self._seqs.items():
            if request_id not in keep and seq.blocks:
                self._free.extend(reversed(seq.blocks))
                seq.blocks, seq.num_computed, seq.proposed = [], 0, []
                freed = True
        return freed

    def _reserve(self, seq: _DraftSequence, num_positions: int) -> bool:
        need = -(-num_positions // self.block_size) - len(seq.blocks)
        if need > len(self._free):
            return False
        for _ in range(need):
            seq.blocks.append(self._free.pop())
        return True

    def _first_pass_start(self, request: Request, held: int) -> int:
        """Where the first proposal pass starts in a history of which the cache holds
        ``held`` tokens: at most ``num_speculative_tokens + 1`` tokens before its last (what
        one speculating step emits) ride in it; the rest is written before."""
        return max(held, request.num_tokens - 1 - (self.num_speculative_tokens + 1))

    def _catch_up(self, active: list[tuple[int, Request, _DraftSequence]]) -> dict[str, int]:
        """Write the draft KV of each request's history but its last few tokens, in passes of
        at most the engine's token budget; returns, per request, where the first proposal
        pass starts. It takes at most ``num_speculative_tokens + 1`` tokens before the last
        (what one speculating step emits) and its requests' tokens stay within the budget;
        the rest of a history is written here."""
        if self.target_kv is not None:  # all but the last token from the target's cache
            self._copy_history([(r, seq, seq.num_computed, r.num_tokens - 1)
                                for _, r, seq in active])
            return {r.request_id: r.num_tokens - 1 for _, r, _ in active}
        first = {r.request_id: self._first_pass_start(r, seq.num_computed)
                 for _, r, seq in active}
        if sum(r.num_tokens - first[r.request_id] for _, r, _ in active) > self.budget:
            first = {r.request_id: r.num_tokens - 1 for _, r, _ in active}
        todo = {r.request_id: seq.num_computed for _, r, seq in active}
        while True:
            items, used = [], 0
            for _, r, seq in active:
                start, end = todo[r.request_id], first[r.request_id]
                take = min(end - start, self.budget - used)
                if take <= 0:
                    continue
                items.append(ScheduledRequest(r.request_id,
                                              r.all_token_ids[start:start + take], start,
                                              [seq.blocks], False, _GREEDY))
                todo[r.request_id] = start + take
                used += take
            if not items:
                return first
            self.runner.write_kv(SchedulerOutput(items, used))


def _load_draft(config: SpeculativeConfig, engine_config: EngineConfig) -> LoadedModel:
    """The draft model, or a ModelLoadError that names --speculative-config (and its
    "draft_num_layers" where that is what does not fit the draft)."""
    mc = engine_config.model
    try:
        return load_model(config.model, mc.device, quantization=config.quantization,
                          dtype=mc.dtype, group_size=mc.int4_group_size,
                          num_layers=config.draft_num_layers)
    except ModelLoadError as e:
        # The loader's words for a layer count the file lacks: "PATH: cannot keep N layers
        # of M; allowed: 1 to M".
        if config.draft_num_layers is not None and "cannot keep" in str(e):
            raise ModelLoadError(f'speculative config (--speculative-config) "draft_num_layers" '
                                 f"{config.draft_num_layers} does not fit the draft model: "
                                 f"{e}") from None
        raise ModelLoadError(f'speculative config (--speculative-config) "model", the draft '
                             f"model: {e}") from None


def _why_not_target_kv(draft: LoadedModel, target: LoadedModel,
                       target_kv: TargetKV | None) -> str:
    """Why the draft cannot read its histories from the target's cache ('' if it can)."""
    if target_kv is None:
        return "no target cache was given"
    if draft.path.resolve() != target.path.resolve():
        return (f"the draft ({draft.path.name}) is not the target's own model "
                f"({target.path.name}) in another format")
    a, b = draft.arch_config, target.arch_config
    if (a.num_key_value_heads, a.head_dim) != (b.num_key_value_heads, b.head_dim) \
            or a.num_hidden_layers > b.num_hidden_layers:
        return "the draft's layers differ from the target's"
    if target_kv.num_groups != 1 or any(b.window(i) is not None
                                        for i in range(b.num_hidden_layers)):
        return "the model has sliding-window layers (the target releases their old blocks)"
    if not all(isinstance(c, PagedKVCache) for c in target_kv.caches):
        return ("the target's KV cache is in a GPU backend's layout (triton_paged); the "
                "draft reads the paged format of the CPU and torch backends only")
    return ""


def _agreed(guess: list[int], tokens: list[int]) -> int:
    """How many guesses the draft's own tokens confirm: ``tokens[j]`` is the draft's token
    after the history and ``guess[:j]``."""
    n = 0
    while n < len(guess) and guess[n] == tokens[n]:
        n += 1
    return n


def _kept(seq: _DraftSequence, history: list[int]) -> int:
    """How many of the last proposal's tokens the target kept and the draft's cache already
    holds (all but the proposal's last token were written), up to the history's last."""
    n, kept = seq.num_computed, 0
    for j, token in enumerate(seq.proposed[:-1]):
        if n + j >= len(history) - 1 or history[n + j] != token:
            break
        kept += 1
    return kept
