"""Frozen configuration, one dataclass per concern, validated at construction."""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace

from llmserve.models.names import DEFAULT_MODEL

SCHEDULING_MODES = ("continuous", "static")
SCHEDULING_POLICIES = ("fcfs", "priority")


def check_field_types(config) -> None:
    """Each field of a config dataclass of the type its annotation names (int, float, bool,
    str, tuples, nested configs, and None where it is optional), and every float finite:
    the Python API's callers get a ValueError naming the field, as the command line's get
    argparse's ("max_model_len must be an integer, got '64'"), not a TypeError from deep
    inside or a value taken silently (64.5 tokens, "no" as true)."""
    hints = _field_hints(type(config))
    for f in fields(config):
        allowed = hints.get(f.name)
        value = getattr(config, f.name)
        if allowed is None:
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            names = {bool: "true or false", int: "an integer", float: "a number",
                     str: "a string", tuple: "a tuple", type(None): "None"}
            kinds = " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in allowed
                                              if not (t is int and float in allowed)))
            raise ValueError(f"{f.name} must be {kinds}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value}")


@functools.cache
def _field_hints(cls: type) -> dict[str, tuple[type, ...]]:
    """Field name -> the types its values may have (fields of other annotations: absent)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        allowed: list[type] = []
        for arg in args:
            arg = typing.get_origin(arg) or arg
            if arg is float:
                allowed += [int, float]
            elif arg in (int, bool, str, tuple, type(None)) or is_dataclass(arg):
                allowed.append(arg)
            else:
                break
        else:
            out[name] = tuple(allowed)
    return out


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's own context length
    quantization: str = "auto"  # auto: what the file holds (GGUF 4-bit -> int4, ...)
    dtype: str | None = None  # of the weights kept dense (None: default_dtype(device))
    int4_group_size: int = 32
    # On CUDA: no CUDA graphs of the decode step (every step runs eagerly).
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        check_device(self.device)
        if self.dtype is None:
            object.__setattr__(self, "dtype", default_dtype(self.device))
        from llmserve.layers.quantization import WeightFormat  # torch: only for a model

        choices = quantization_choices()
        if self.quantization not in choices:
            raise ValueError(f"quantization must be one of {choices}, got {self.quantization!r}")
        # The weight format checks dtype and group size (``auto`` is resolved at load).
        WeightFormat("none", self.dtype, self.int4_group_size)


def check_device(device: str, *, available: bool = False) -> None:
    """``device`` is ``cpu``, ``cuda`` or ``cuda:N``, and with ``available`` one this process
    can use (checked where the model loads: a Ray head may configure GPUs it lacks); else a
    ValueError that says what is allowed or available."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: llmserve runs on cpu, cuda or cuda:N")
    if dev.type != "cuda" or not available:
        return
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(f"device {device!r}: no CUDA GPU is available to this process "
                         f"(PyTorch {torch.__version__}, {build}); use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {device!r}: this process sees {count} CUDA GPU(s), "
                         f"cuda:0 to cuda:{count - 1}")


def default_dtype(device: str) -> str:
    """Dense weights' dtype when none is given: bfloat16 on CUDA, float32 elsewhere."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def default_block_size(device: str) -> int:
    """Tokens per KV block when none is given: 32 on CPU, 16 on CUDA.

    The CPU attention kernel reads each block where the pool put it and pays per block: a
    read of scattered memory (1 KiB pieces at blocks of 16 tokens, which this project's Zen 4
    host reads at a quarter of its streaming bandwidth) and a float step per block and
    query vector. For 64 decodes of ~260 tokens over 30 layers, blocks of 32 take 0.8x the
    time of blocks of 16, and 64 streams through the server give 1.13x the output tokens/s
    (BENCHMARKS.md, session 41). Larger blocks gain a little more in the kernel but cache
    prefixes in coarser steps. The GPU kernel tiles contexts on its own: 16 stays there, as
    in vLLM.
    """
    return 16 if device.startswith("cuda") else 32


def quantization_choices() -> tuple[str, ...]:
    from llmserve.layers.quantization import list_quantization_methods

    return ("auto", *list_quantization_methods())


# The largest KV block: vLLM's largest choice too. Blocks are the prefix cache's unit and
# a request's last block is partly empty, so larger ones waste memory and cached prefixes
# for little gain in the kernels (see default_block_size).
MAX_BLOCK_SIZE = 256


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = None  # None: default_block_size(device), set by EngineConfig
    kv_cache_memory_gib: float | None = None  # default: see kv_cache.sizing
    num_blocks: int | None = None  # overrides the memory budget (tests, benchmarks)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto: int8 for quantized weights on CPU, else the dtype
    # Sliding-window layers in KV cache groups of their own that release the blocks their
    # window leaves; False: one block table for every layer, each keeping its whole context.
    hybrid_kv_cache: bool = True

    def __post_init__(self) -> None:
        from llmserve.attention.kv_format import KV_CACHE_DTYPE_CHOICES

        check_field_types(self)
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size is not None and (
                not 1 <= self.block_size <= MAX_BLOCK_SIZE
                or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size (--block-size) must be a power of two from 1 to "
                             f"{MAX_BLOCK_SIZE}, got {self.block_size}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    scheduling: str = "continuous"
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Plan a decode step while the one before runs, its input tokens read from the step
    # before's samples on the device (None: on with CUDA; on a CPU a step's host work cannot
    # overlap its kernels, so off).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true, false or null, got "
                             f"{self.async_scheduling!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_MODES}, "
                             f"got {self.scheduling!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, named like vLLM's ``--speculative-config`` JSON.

    method: ``ngram`` (prompt lookup over the request's own tokens), ``suffix`` (the same,
        then over the tokens of recent requests) or ``draft`` (a smaller model with the same
        vocabulary proposes greedily).
    num_speculative_tokens: most draft tokens a request verifies per step (the planner may
        use fewer, or none when the batch is busy).
    prompt_lookup_min / prompt_lookup_max: n-gram lengths matched against the history.
    model: the draft model (``draft``): a path or a name, like --model.
    draft_num_layers: run only the first layers of the draft model (``draft``; a
        layer-truncated copy of the target makes a draft where no smaller sibling exists).
    quantization: the draft model's weight format (default: what its file holds).
    suffix_decoding_max_cached_requests: recent requests whose tokens ``suffix`` matches
        against (vLLM's name).
    draft_prompt_lookup: the draft model checks, in each of its passes, what a prompt
        lookup (``prompt_lookup_min``/``_max``) expects next, and skips a pass for each
        token it confirms (``draft``; on unless false: the same proposals in fewer passes).
    adaptive: speculate only where the measured cost of steps and the guard over real
        steps expect a gain (the default: under load speculation switches itself off);
        false: every decoding request proposes up to ``num_speculative_tokens`` in every
        step, as vLLM does.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_num_layers: int | None = None
    quantization: str = "auto"
    suffix_decoding_max_cached_requests: int = 256
    draft_prompt_lookup: bool | None = None
    draft_kv_from_target: bool | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) \
                or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be an integer in [1, 16], "
                             f"got {self.num_speculative_tokens!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 32):
            raise ValueError("prompt_lookup_min and prompt_lookup_max must be integers with "
                             f"1 <= min <= max <= 32, got {lo!r} and {hi!r}")
        if self.method == "draft" and not self.model:
            raise ValueError('speculative method "draft" needs "model": the draft model')
        if self.method != "draft" and (self.model or self.draft_num_layers
                                       or self.draft_prompt_lookup is not None
                                       or self.draft_kv_from_target is not None):
            raise ValueError('"model", "draft_num_layers", "draft_prompt_lookup" and '
                             '"draft_kv_from_target" apply to method "draft" only')
        cached = self.suffix_decoding_max_cached_requests
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 1:
            raise ValueError("suffix_decoding_max_cached_requests must be a positive integer, "
                             f"got {cached!r}")
        for name in ("draft_prompt_lookup", "draft_kv_from_target"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.draft_num_layers is not None and (
                not isinstance(self.draft_num_layers, int) or self.draft_num_layers < 1):
            raise ValueError(f"draft_num_layers must be a positive integer, "
                             f"got {self.draft_num_layers!r}")
        choices = quantization_choices()
        if self.quantization not in choices:
            raise ValueError(f'speculative config (--speculative-config) "quantization", the '
                             f"draft model's weight format, must be one of {choices}, got "
                             f"{self.quantization!r}")
        if self.model:  # last: the other mistakes are named whatever the model
            from llmserve.errors import LLMServeError
            from llmserve.models.loader import resolve_model_path  # torch: as ModelConfig

            try:
                resolve_model_path(self.model)
            except LLMServeError as e:
                raise ValueError(f'speculative config (--speculative-config) "model", the '
                                 f"draft model: {e}") from None

    @classmethod
    def from_json(cls, text: str | dict) -> SpeculativeConfig:
        """From vLLM-style JSON: ``{"method": "ngram", "num_speculative_tokens": 4}``."""
        import json
        from dataclasses import fields

        if not isinstance(text, str | dict):
            raise TypeError("speculative_config must be a dict (like vLLM's: {\"method\": "
                            "\"ngram\", \"num_speculative_tokens\": 4}), a SpeculativeConfig "
                            f"or JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; "
                             f"allowed: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        if not -2**63 <= self.seed < 2**64:  # what torch.manual_seed takes
            raise ValueError(f"seed must be in [-2^63, 2^64), got {self.seed}")
        memory = self.cache.kv_cache_memory_gib
        if memory is not None and not self.model.device.startswith("cuda"):
            from llmserve.kv_cache.sizing import check_kv_cache_memory

            check_kv_cache_memory(memory, self.model.device)  # CUDA: where the model loads
        from llmserve.attention.kv_format import GPU_ONLY_KV_CACHE_DTYPES

        if (self.cache.kv_cache_dtype in GPU_ONLY_KV_CACHE_DTYPES
                and not self.model.device.startswith("cuda")):
            from llmserve.attention.kv_format import KV_CACHE_DTYPES

            raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) {self.cache.kv_cache_dtype} "
                             f"is stored on GPUs only; on {self.model.device} choose one of "
                             f"{('auto', *KV_CACHE_DTYPES)}")
        if self.cache.block_size is None:
            object.__setattr__(self, "cache", replace(
                self.cache, block_size=default_block_size(self.model.device)))
        if self.scheduler.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling cannot be combined with speculative decoding: "
                             "a step's proposals need the tokens of the step before; turn "
                             "one of them off")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the --model value
    max_queued_requests: int | None = 256
    max_queued_tokens: int | None = None
    request_timeout: float | None = None  # seconds
    shutdown_timeout: float = 30.0  # seconds to let running requests finish on SIGTERM
    max_body_bytes: int = 4 * 1024 * 1024
    # The watchdog: an engine with work and no step for this long is killed and restarted;
    # more than engine_max_restarts restarts within engine_restart_window s: exit 1.
    engine_hang_timeout: float = 60.0
    engine_max_restarts: int = 5
    engine_restart_window: float = 300.0
    # Host header names answered (None: any; the CLI defaults to the loopback names when
    # bound to loopback), and the deadlines for a client's headers and each body chunk.
    allowed_hosts: tuple[str, ...] | None = None
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    # The usage database (API keys, limits, usage): a SQLAlchemy URL, else SQLite under
    # data_dir (default: $LLMSERVE_DATA_DIR or the user's data directory); none at all with
    # use_database False. Request logs: "off", "metadata" or "full" (prompts and outputs).
    use_database: bool = True
    data_dir: str | None = None
    database_url: str | None = None
    request_log: str = "off"
    cost_per_hour: float | None = None  # the console's cost per 1K output tokens
    # The chat template instead of the model's own: Jinja text, or a file holding it.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.api_key is not None and (not self.api_key.strip()
                                         or self.api_key != self.api_key.strip()):
            what = "is empty" if not self.api_key.strip() else \
                "starts or ends with white space (a request's header cannot carry it)"
            raise ValueError(f"--api-key {what}: give a key of visible characters, or leave "
                             "--api-key out for a server without the shared key")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("--chat-template is empty: give a Jinja template or a file "
                             "holding one, or leave --chat-template out for the model's own")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_queued_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {value}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request-timeout must be > 0 seconds, got {self.request_timeout}")
        if self.engine_hang_timeout <= 0:
            raise ValueError(f"engine-hang-timeout must be > 0 seconds, "
                             f"got {self.engine_hang_timeout}")
        if self.engine_max_restarts < 0:
            raise ValueError(f"engine-max-restarts must be >= 0, got {self.engine_max_restarts}")
        if self.engine_restart_window <= 0:
            raise ValueError(f"engine-restart-window must be > 0 seconds, "
                             f"got {self.engine_restart_window}")
        if self.request_log not in ("off", "metadata", "full"):
            raise ValueError(f"request-log must be off, metadata or full, got "
                             f"{self.request_log!r}")
        if self.cost_per_hour is not None and not 0 <= self.cost_per_hour < float("inf"):
            raise ValueError(f"cost-per-hour must be a price >= 0, got {self.cost_per_hour}")
        for name in ("header_timeout", "body_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0 seconds, "
                                 f"got {getattr(self, name)}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
