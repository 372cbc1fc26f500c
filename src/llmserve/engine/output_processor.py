"""Frontend-side output processing: incremental text, stop strings, logprobs, n sequences.

The engine core produces token ids; this turns them into what users see. Text is released
only when it is decided: never a partial UTF-8 character, and never text that may still
turn out to be the start of a stop string (held back until the next tokens decide, and
flushed when the sequence ends). When a stop string appears, the text is cut before it
(or after it, with include_stop_str_in_output) and the engine is told to stop the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.messages import EngineCoreOutput
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import TokenLogprobs
from llmserve.tokenizer import Tokenizer


@dataclass
class SequenceDelta:
    """What one sequence gained in one step (for streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class _Sequence:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    sent: int = 0  # characters of text released so far
    checked: int = 0  # characters already searched for stop strings
    cut: int | None = None  # end of the visible text once a stop string matched
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return self.detok.text if self.cut is None else self.detok.text[:self.cut]


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.seqs = [_Sequence(i, IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                         params.skip_special_tokens),
                               logprobs=[] if params.logprobs is not None else None)
                     for i in range(params.n)]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids,
            [CompletionOutput(s.index, s.text, list(s.token_ids), s.finish_reason,
                              s.stop_reason, s.logprobs) for s in self.seqs],
            finished=self.finished, num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs)

    def apply(self, out: EngineCoreOutput) -> tuple[SequenceDelta, bool]:
        """Fold one engine output in; returns the delta and whether a stop string ended the
        sequence (the engine must then be told to stop it)."""
        seq = self.seqs[out.index]
        if out.index == 0:
            # The prompt's prefix-cache hit is the first sequence's: the others wait for it
            # to compute the prompt and then share its blocks, which is not a cache hit.
            self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None if e is None else self._logprob_dict(e)
                                    for e in out.prompt_logprobs]
            self.prompt_logprobs[0] = None
        # Token by token: a stop string completed by one of several tokens of a step
        # (speculative decoding) ends the sequence at that token, as it would without.
        new_ids: list[int] = []
        new_lps: list | None = [] if seq.logprobs is not None and out.new_logprobs else None
        stopped_by_string = False
        # The end of sequence or stop token that ended it is not text (unless asked for),
        # special or not: vLLM's detokenizer leaves it out too.
        last = len(out.new_token_ids) - 1
        stop_token = (out.finished and out.finish_reason == "stop"
                      and not self.params.include_stop_str_in_output)
        for i, token in enumerate(out.new_token_ids):
            new_ids.append(token)
            if new_lps is not None and out.new_logprobs[i] is not None:
                new_lps.append(self._logprob_dict(out.new_logprobs[i]))
            if not (stop_token and i == last):
                seq.detok.add_tokens([token])
            if out.finished and i == last:
                seq.detok.flush()
            if self._check_stop_strings(seq, len(seq.token_ids) + len(new_ids)):
                stopped_by_string = True
                break
        seq.token_ids.extend(new_ids)
        if new_lps is not None:
            seq.logprobs.extend(new_lps)
        ended_here = out.finished and len(new_ids) == len(out.new_token_ids)
        if stopped_by_string:
            seq.finish_reason = "stop"
        elif out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        text = seq.text
        end = len(text) if seq.finish_reason else len(text) - self._held_back(text)
        delta_text = text[seq.sent:max(end, seq.sent)]
        seq.sent = max(end, seq.sent)
        delta = SequenceDelta(self.request_id, seq.index, delta_text, new_ids,
                              new_lps, seq.finish_reason, seq.stop_reason)
        return delta, stopped_by_string and not ended_here

    def _check_stop_strings(self, seq: _Sequence, num_tokens: int) -> bool:
        """Whether a stop string ends the sequence's text, now ``num_tokens`` long: not
        before ``min_tokens`` tokens (the text of the first ones is passed over, as vLLM
        does; a stop string may still begin in it)."""
        stops = self.params.stop
        if not stops or seq.cut is not None:
            return False
        text = seq.detok.text
        if num_tokens <= self.params.min_tokens:
            seq.checked = len(text)
            return False
        checked, seq.checked = seq.checked, len(text)
        best: tuple[int, str] | None = None
        for stop in stops:  # one that ends in the new text
            pos = text.find(stop, max(0, checked - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        seq.cut = pos + len(stop) if self.params.include_stop_str_in_output else pos
        seq.stop_reason = stop
        return True

    def _held_back(self, text: str) -> int:
        """Length of the longest end of ``text`` that could begin a stop string."""
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        ids, lps, chosen_rank = entry
        out = {ids[0]: Logprob(lps[0], chosen_rank, self.tokenizer.token_text(ids[0]))}
        for rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            out.setdefault(tid, Logprob(lp, rank, self.tokenizer.token_text(tid)))
        return out


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> RequestState:
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer)
        self.states[request_id] = state
        return state

    def process(self, outputs: list[EngineCoreOutput]
                ) -> tuple[list[SequenceDelta], list[tuple[str, int]]]:
        """Returns the deltas, and (request id, index) of sequences a stop string ended."""
        deltas, to_stop = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None or state.seqs[out.index].finish_reason is not None:
                continue  # aborted meanwhile, or already ended by a stop string
            delta, stop = state.apply(out)
            deltas.append(delta)
            if stop:
                to_stop.append((out.request_id, out.index))
        return deltas, to_stop

    def finish_aborted(self, request_id: str) -> RequestState | None:
        """Mark what is left of a request as aborted and forget it."""
        state = self.states.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
        return state

    def pop(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)
