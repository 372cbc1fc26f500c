"""Per-request grammar matchers in the engine, and the token masks of each step.

The runner asks for the masks of a step before its forward pass; they are computed on a
worker thread while the model runs (llguidance releases the GIL, PyTorch's kernels do
too) and collected after the logits, so a constrained step costs the forward pass plus
applying the masks. A request verifying k draft tokens gets k + 1 masks: row j is the
grammar's state after drafts 0..j-1 (walked forward, then rolled back), so a draft the
grammar forbids is rejected by verification like any other mismatch, and the rows after
it are discarded anyway.

A matcher follows the tokens the request emits (``accept``); it lives until the request
ends (``free``), through preemption (a preempted request keeps its output).

A grammar that passes the checks when the request is made can still fail while it
generates: llguidance builds its lexer and parser states lazily and gives up past its
limits (a schema that refers to itself, a regex of a million repeats). The mask then
allows only the end of the sequence, and the failure is kept (``take_failed``): the engine
ends the request as failed, with llguidance's reason, rather than answer with text that
stopped short of the grammar.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from llguidance import LLMatcher, LLTokenizer

from llmserve.logger import get_logger
from llmserve.scheduler.output import ScheduledRequest
from llmserve.structured_output.grammar import compile_grammar
from llmserve.tokenizer.tokenizer import Tokenizer

logger = get_logger(__name__)


class GrammarBackend:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the width of the logits (may exceed the vocabulary)
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._matchers: dict[str, LLMatcher] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._failed: dict[str, str] = {}  # request id -> llguidance's error (take_failed)
        self._reported: set[str] = set()  # requests whose failure was kept, until freed
        self._failed_lock = threading.Lock()  # written by the worker, taken by the engine

    @functools.cached_property
    def ll_tokenizer(self) -> LLTokenizer:
        """llguidance's view of the vocabulary (built once, about a second)."""
        return LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                           eos_token=self.eos_token_ids or None)

    def warm_up(self) -> Future:
        """Build the tokenizer view in the background, so no request waits for it."""
        return self._pool.submit(lambda: self.ll_tokenizer)

    def submit(self, items: list[ScheduledRequest]) -> Future[torch.Tensor]:
        """Start computing the masks of the constrained requests among ``items`` (those
        that sample this step): int32 [rows, words], k + 1 rows per request, in order."""
        return self._pool.submit(self.masks, items)

    def masks(self, items: list[ScheduledRequest]) -> torch.Tensor:
        rows = sum(s.num_draft_tokens + 1 for s in items)
        bitmask = torch.full((rows, self.words), -1, dtype=torch.int32)
        row = 0
        for s in items:
            matcher = self._matcher(s)
            drafts = s.draft_token_ids
            walked = matcher.validate_tokens(drafts) if drafts else 0
            for j in range(walked + 1):  # row j: after drafts 0..j-1
                self._fill(s.request_id, matcher, bitmask[row + j])
                if j < walked:
                    matcher.consume_token(drafts[j])
            if matcher.is_stopped():
                # The grammar is complete: its mask allows only the end of the sequence, and
                # an end-of-sequence draft is not walked (a stopped matcher takes no token)
                # yet may be accepted (with ignore_eos): every later row keeps that mask.
                bitmask[row + walked + 1:row + s.num_draft_tokens + 1] = bitmask[row + walked]
            if walked:
                matcher.rollback(walked)
            row += s.num_draft_tokens + 1  # rows past a forbidden draft stay all-allowed
        return bitmask

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        """The request emitted these tokens: move its matcher on."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        for t in token_ids:
            if matcher.is_stopped() or matcher.is_error():  # complete, or failed (its mask
                return  # allowed only the end of the sequence)
            if not matcher.consume_token(t):
                logger.warning("request %s: the grammar refused token %d: %s", request_id, t,
                               matcher.get_error())
                return

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        with self._failed_lock:
            self._reported.discard(request_id)

    def take_failed(self) -> dict[str, str]:
        """Requests whose grammar failed since the last call, with llguidance's reason (the
        first line of its error: "lexer error: too many expressions constructed")."""
        with self._failed_lock:
            failed, self._failed = self._failed, {}
        return failed

    def _matcher(self, s: ScheduledRequest) -> LLMatcher:
        matcher = self._matchers.get(s.request_id)
        if matcher is None:
            assert s.sampling_params.structured_outputs is not None
            grammar = compile_grammar(s.sampling_params.structured_outputs)
            matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            self._matchers[s.request_id] = matcher
        return matcher

    def _fill(self, request_id: str, matcher: LLMatcher, target: torch.Tensor) -> None:
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        if matcher.is_error():  # before, or while computing this mask
            with self._failed_lock:
                if request_id not in self._reported:
                    error = matcher.get_error()  # its reason, then the matcher's state
                    reason = error.strip().split("\n", 1)[0]
                    logger.warning("request %s: its grammar failed while generating: %s",
                                   request_id, reason)
                    logger.debug("request %s: the grammar's state: %s", request_id, error)
                    self._reported.add(request_id)
                    self._failed[request_id] = reason
            # Only the end of the sequence is left: end the request rather than emit text
            # outside the grammar (the engine reports it failed).
            target.zero_()
            for t in self.eos_token_ids:
                target[t // 32] |= _bit(t % 32)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
