"""The messages between the API server process and the engine process, and their codec.

Plain typed data and nothing else: no queues, no event loops, no shared objects. A test
can build any of them by hand. They travel as msgpack (msgspec: typed decoding, ~1 µs per
small message) over ZeroMQ sockets; see engine/core_proc.py for the transport.

API server -> engine: ``AddRequest``, ``AbortRequest``, ``Shutdown``, ``ResetPrefixCache``.
Engine -> API server: ``EngineReady`` once, then one ``StepOutputs`` per step (also for
steps that only computed prefill, so that a silent engine means a stuck one), and
``UtilityResult`` for each utility call, and ``EngineFailed`` as its last word when it dies
of an exception.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import msgspec

from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import SchedulerStats, TokenLogprobs


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    """End a request (all its sequences, or only sequence ``index``). ``stopped``: the API
    server matched a stop string (finish reason "stop" rather than "abort")."""

    request_id: str
    index: int | None = None
    stopped: bool = False


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """Forget every cached prefix (only while no request runs); answered by a
    UtilityResult with the same call_id."""

    call_id: int


EngineInput = AddRequest | AbortRequest | Shutdown | ResetPrefixCache


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one sequence.

    With n > 1 each of the n sequences is an engine request of its own: ``request_id`` is
    the user's request, ``index`` says which sequence.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprobs | None] | None = None  # one per new token, if asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first token
    first_scheduled_time: float | None = None  # time.monotonic() when first scheduled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestFailed(msgspec.Struct, array_like=True):
    """A request the engine refused or could not process; the others go on."""

    request_id: str
    message: str
    code: str | None = None  # the error envelope's code, where the failure has its own


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    failed: list[RequestFailed]
    num_added: int  # AddRequests received so far (the API server counts what it sent)
    tokens_added: int  # their prompt tokens
    waiting_tokens: int  # prompt tokens of the requests waiting to be scheduled


class ModelCard(msgspec.Struct, array_like=True):
    """What the console shows of the loaded model and its KV cache."""

    architecture: str
    num_parameters: int
    weight_format: str
    weight_bytes: int
    kv_cache_dtype: str
    kv_block_size: int
    kv_bytes_per_token: int
    kv_capacity_tokens: int  # the longest sequence the cache holds
    device: str
    speculative: str | None = None
    kv_bytes_per_sequence: int = 0  # of a full-context sequence, sliding windows included
    kv_full_context_sequences: float = 0.0  # full-context sequences the cache holds at once


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    max_model_len: int
    vocab_size: int
    stats: SchedulerStats
    load_seconds: float  # model load
    kv_cache_seconds: float
    warm_up_seconds: float
    description: str  # the loaded model, one line
    card: ModelCard


class UtilityResult(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    ok: bool
    message: str


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str
    user_error: bool = False  # a bad model path or option, not a bug: no traceback needed


EngineOutput = StepOutputs | EngineReady | EngineFailed | UtilityResult


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, MappingProxyType):  # SamplingParams.logit_bias
        return dict(obj)
    raise NotImplementedError(f"cannot send {type(obj).__name__} to or from the engine")


class Codec:
    """msgpack with a typed decoder for each direction."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.inputs = msgspec.msgpack.Decoder(EngineInput)
        self.outputs = msgspec.msgpack.Decoder(EngineOutput)

    def encode(self, message: EngineInput | EngineOutput) -> bytes:
        return self._encoder.encode(message)
