"""Resolve ``--model`` (a known name, a GGUF file or a Hugging Face directory) and load it.

Nothing here reaches a model hub: a name resolves to a file shipped in an installed package.
Every failure is a ``ModelLoadError`` whose one-line message names the file and the problem.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import itertools
import json
import re
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmserve.config import check_device
from llmserve.csrc import cpu_ops
from llmserve.errors import ModelLoadError
from llmserve.layers.quantization import WeightFormat
from llmserve.models.arch_config import ArchConfig
from llmserve.models.gguf_loader import GGUFFile
from llmserve.models.names import DEFAULT_MODEL, NAMED_MODELS
from llmserve.models.registry import config_from_hf, get_model_class, supported_architectures
from llmserve.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    arch_config: ArchConfig
    path: Path
    name: str  # what the user asked for (shown by /v1/models and logs)
    weight_format: WeightFormat = field(default_factory=WeightFormat)
    weight_bytes: int = 0  # resident bytes of every weight and buffer of the model
    load_seconds: float = 0.0
    peak_rss_bytes: int = 0  # the process's peak resident memory when loading ended

    @property
    def weight_description(self) -> str:
        """E.g. "int4 (groups of 32) layers, int8 embedding/head"."""
        fmt = self.weight_format
        body = fmt.quantization if fmt.quantization != "none" else fmt.dtype
        if fmt.quantization == "int4":
            body += f" (groups of {fmt.group_size})"
        head = fmt.head_quantization if fmt.quantization != "none" else fmt.dtype
        return f"{body} layers, {head} embedding/head"

    def describe(self) -> str:
        return (f"loaded {self.path.name} in {self.load_seconds:.1f} s: "
                f"{self.weight_description}, weights {self.weight_bytes / 2**20:.0f} MiB, "
                f"peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB")


def resolve_model_path(model: str) -> Path:
    if model in NAMED_MODELS:
        package, filename, hint = NAMED_MODELS[model]
        spec = importlib.util.find_spec(package)  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"{model}: the model package {package!r} is not installed "
                                 f"(install it with: {hint})")
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise ModelLoadError(f"{path}: the package {package!r} does not contain {filename}")
        return path
    names = ", ".join(sorted(NAMED_MODELS))
    if not model.strip():
        raise ModelLoadError(f"the model is an empty name: give a GGUF file, a Hugging Face "
                             f"model directory or a known model name ({names})")
    try:
        path = Path(model).expanduser()
    except RuntimeError as e:  # ~user of an unknown user
        raise ModelLoadError(f"{model}: {e}") from None
    try:
        path.stat()
    except FileNotFoundError:
        raise ModelLoadError(f"{model}: no such file or directory (and not a known model "
                             f"name; known: {names})") from None
    except OSError as e:
        raise ModelLoadError(f"{model}: cannot be read ({e.strerror})") from None
    if not (path.is_file() or path.is_dir()):
        raise ModelLoadError(f"{model}: neither a regular file nor a directory")
    return path


def load_model(model: str = DEFAULT_MODEL, device: str | torch.device = "cpu", *,
               quantization: str = "auto", dtype: str = "float32",
               group_size: int = 32, num_layers: int | None = None) -> LoadedModel:
    """Build the model directly in its weight format and fill it tensor by tensor.

    ``quantization="auto"`` keeps what the file holds as close as the methods allow: a
    GGUF file of 4-bit blocks loads as int4, one of 8-bit blocks as int8, anything else
    dense in ``dtype``. ``num_layers`` keeps only the first layers (a layer-truncated copy,
    used as a speculative draft model).
    """
    start = time.perf_counter()
    try:
        check_device(str(device), available=True)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    path = resolve_model_path(model)
    gguf = None
    if path.is_dir():
        cfg, tokenizer, weights = _open_hf_dir(path)
    else:
        gguf = GGUFFile(path)
        cfg, tokenizer = _open_gguf(gguf)
    on_cpu = torch.device(device).type == "cpu"
    if quantization == "auto":  # on a GPU: dense (the quantized formats are CPU kernels)
        quantization = _auto_quantization(gguf) if on_cpu else "none"
    fmt = WeightFormat(quantization, dtype, group_size)
    if fmt.quantization != "none" and not on_cpu:
        raise ModelLoadError(f"--quantization {fmt.quantization} runs on CPU only; "
                             f"use --quantization none on {device}")
    if fmt.dtype == "float16" and on_cpu:
        raise ModelLoadError("--dtype float16 runs on GPUs only; on CPU use float32 or "
                             "bfloat16")
    if gguf is not None:
        keep_blocks = fmt.quantization == "int4" and fmt.group_size == 32
        weights = gguf.weights(cfg, keep_q4_blocks=keep_blocks)
    if num_layers is not None:
        cfg, weights = _first_layers(cfg, weights, num_layers, path)
    cls = _model_class(path, cfg)
    if torch.device(device).type == "cpu":
        cpu_ops()  # built (or found) now; a bad LLMSERVE_CPU_ISA fails here, with its name
    with torch.device(device):
        net = cls(cfg, fmt)
    try:
        net.load_weights(weights)
    except ValueError as e:
        raise ModelLoadError(f"{path}: weights do not match the configuration ({e})") from None
    net.eval()
    _release_freed_memory()
    nbytes = sum(t.numel() * t.element_size()
                 for t in itertools.chain(net.parameters(), net.buffers()))
    return LoadedModel(net, tokenizer, cfg, path, model, fmt, nbytes,
                       time.perf_counter() - start, peak_rss_bytes())


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _first_layers(cfg: ArchConfig, weights: Iterator[tuple[str, torch.Tensor]],
                  num_layers: int, path: Path):
    if not 1 <= num_layers <= cfg.num_hidden_layers:
        raise ModelLoadError(f"{path}: cannot keep {num_layers} layers of "
                             f"{cfg.num_hidden_layers}; allowed: 1 to {cfg.num_hidden_layers}")

    def kept():
        for name, tensor in weights:
            m = _LAYER_INDEX.search(name)
            if m is None or int(m.group(1)) < num_layers:
                yield name, tensor

    return cfg.first_layers(num_layers), kept()


def load_tokenizer(model: str = DEFAULT_MODEL) -> Tokenizer:
    """The model's tokenizer alone (the API server's share of a model), without weights."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _open_hf_dir(path)[1]
    return _open_gguf(GGUFFile(path))[1]


def _release_freed_memory() -> None:
    """Hand the heap pages freed by loading (per-tensor float32 copies) back to the OS;
    glibc keeps them otherwise, and they would count as resident for the server's life."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# Types the int4 format holds exactly (groups of 32 with a scale and an offset, kept as
# the file's own blocks); any other sub-8-bit type would be quantized a second time.
_EXACT_INT4 = {"Q4_0", "Q4_1"}
_BELOW_8_BITS = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K", "Q6_K"}


def _auto_quantization(gguf: GGUFFile | None) -> str:
    """int4 for files whose compressed layers are Q4_0/Q4_1 (loaded as they are); int8 for
    any other compressed file: re-quantizing 5- and 6-bit (or K-quant) weights to 4 bits
    lost 32% perplexity on Gemma 3 270M's Q4_K_M file, int8 stays within 1%."""
    if gguf is None:
        return "none"
    types = gguf.weight_types()
    compressed = types & _BELOW_8_BITS
    if compressed and compressed <= _EXACT_INT4:
        return "int4"
    if compressed or "Q8_0" in types:
        return "int8"
    return "none"


def _model_class(path: Path, cfg: ArchConfig) -> type[nn.Module]:
    try:
        return get_model_class(cfg.architecture)
    except KeyError:
        raise ModelLoadError(f"{path}: unknown architecture {cfg.architecture!r} (supported: "
                             f"{', '.join(supported_architectures())})") from None


def _open_gguf(gguf: GGUFFile) -> tuple[ArchConfig, Tokenizer]:
    cfg = gguf.arch_config()
    try:
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    except Exception as e:
        raise ModelLoadError(f"{gguf.path}: cannot build the tokenizer ({e})") from None
    return cfg, tokenizer


def _open_hf_dir(path: Path) -> tuple[ArchConfig, Tokenizer, Iterator[tuple[str, torch.Tensor]]]:
    config_file = path / "config.json"
    try:
        if not config_file.is_file():
            raise ModelLoadError(f"{path}: not a model directory (no config.json)")
        raw = json.loads(config_file.read_bytes())
        cfg = config_from_hf(raw)
    except OSError as e:
        raise ModelLoadError(f"{e.filename or config_file}: cannot be read "
                             f"({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file}: invalid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{config_file}: invalid JSON (not UTF-8 text: {e})") from None
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{config_file}: missing or invalid field {e}") from None
    except ValueError as e:
        raise ModelLoadError(f"{config_file}: {e}") from None
    _model_class(path, cfg)
    shards = _weight_files(path)
    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except Exception as e:
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ModelLoadError(f"{path}: no tokenizer files (tokenizer.json, or "
                                 "tokenizer.model, or vocab.json with merges.txt)") from None
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({e})") from None
    return cfg, tokenizer, _safetensors_weights(shards)


_INDEX = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files to load, as transformers picks them: those the index's
    ``weight_map`` names (a sharded checkpoint), else ``model.safetensors``, else every
    ``*.safetensors`` file. Each must be readable."""
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
            if not names or not all(isinstance(n, str) and "/" not in n for n in names):
                raise ValueError("its files must be names in this directory")
        except OSError as e:
            raise ModelLoadError(f"{index}: cannot be read ({e.strerror})") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index (a JSON object whose "
                                 f"weight_map maps tensor names to files: {e!r})") from None
        shards = [path / n for n in names]
        missing = [n for n, f in zip(names, shards) if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: {len(missing)} of the {len(names)} weight files "
                                 f"named by {_INDEX} are missing: {', '.join(missing[:3])}")
    elif (path / "model.safetensors").is_file():
        shards = [path / "model.safetensors"]
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{path}: no *.safetensors weights (pickled .bin checkpoints are "
                             "not loaded for safety)")
    for shard in shards:
        try:
            with open(shard, "rb"):
                pass
        except OSError as e:
            raise ModelLoadError(f"{shard}: cannot be read ({e.strerror})") from None
    return shards


def _safetensors_weights(shards: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    seen: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                    if name in seen:
                        raise ModelLoadError(f"{shard}: tensor {name!r} is also in "
                                             f"{seen[name].name}: which to load is unclear")
                    seen[name] = shard
                    yield name, f.get_tensor(name).float()
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{shard}: unreadable safetensors file ({e})") from None
