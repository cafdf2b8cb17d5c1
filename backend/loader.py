"""Load a model — a Hugging Face checkpoint directory or a GGUF file — with strict checks.

Weights are treated as download-locked assets. Before a single tensor is read:
  * the shard index is compared with the files on disk, and an optional sha256 manifest is
    checked (`backend/checkpoint_files.py`);
  * every tensor name and shape is compared with the model built from config.json.
Any problem raises `WeightError` naming the shard or tensor; no parameter is ever left at random
init (the model is built on the meta device, so an unassigned one could not even run).
A GGUF file (`backend/gguf_weights.py`) gets the same checks against its own metadata, and each
tensor is dequantized into the serving dtype; a damaged file names its tensor or offset.

Load formats (`--load-format`, as vLLM's flag; our values):
  * mmap (default): each shard is memory-mapped and tensors are views of the mapping
    (private, copy-on-write, never written). On CPU, where the checkpoint's dtype is the one
    served, the weights stay file-backed: start-up reads no weights (beyond a sha256
    manifest's check), pages fault in on first use and live in the page cache, shared by
    every process serving the same files. A dtype conversion, or a copy to the GPU, reads the
    mapping once into new memory instead.
  * eager: each shard is read whole with read() and deserialized from those bytes, so every
    byte is in process (or GPU) memory before the engine is built (llama.cpp's --no-mmap): no
    page faults on the first requests, nothing the kernel can drop under memory pressure.
    Host memory peaks at the weights plus one shard (the bytes and their tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors_bytes

from prefixgate.backend import gguf_weights
from prefixgate.backend.checkpoint_files import (
    INDEX_NAME,
    WeightError,
    check_manifest,
    find_manifest,
    weight_files,
)
from prefixgate.backend.config import LOAD_FORMATS
from prefixgate.backend.models import LlamaConfig, build_model
from prefixgate.common.gguf_file import GGUFError, open_gguf
from prefixgate.common.schema import ConfigError

# Tensors some exporters add that carry no weights we need.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


# --- checks (each returns a list of readable problems) ---------------------------------------


def scan_tensors(files: list[Path], weight_map: dict[str, str] | None) -> tuple[dict, list[str]]:
    """Tensor name -> (file, shape), read from safetensors headers only (no tensor data)."""
    found, problems = {}, []
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in found:
                        problems.append(f"tensor {name} appears in both "
                                        f"{found[name][0].name} and {path.name}")
                    found[name] = (path, tuple(f.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as e:
            problems.append(f"{path.name} is not a readable safetensors file: {e}")
    for name, shard in (weight_map or {}).items():
        if name in found and found[name][0].name != shard:
            problems.append(f"tensor {name} is in {found[name][0].name}, "
                            f"but {INDEX_NAME} says {shard}")
    return found, problems


def check_tensors(expected: dict[str, tuple], found: dict, config: LlamaConfig) -> list[str]:
    problems = [f"missing tensor {n}" for n in expected if n not in found]
    for name, (path, shape) in found.items():
        if name in expected:
            if tuple(expected[name]) != shape:
                problems.append(
                    f"shape mismatch for {name} in {path.name}: checkpoint {list(shape)}, "
                    f"config.json implies {list(expected[name])}"
                )
        elif not _ignorable(name, config):
            problems.append(f"unexpected tensor {name} in {path.name}")
    return problems


def _ignorable(name: str, config: LlamaConfig) -> bool:
    # Tied checkpoints sometimes still store the head; the model uses the embedding instead.
    return name.endswith(_HARMLESS_SUFFIXES) or (name == "lm_head.weight"
                                                 and config.tie_word_embeddings)


def expected_shapes(config: LlamaConfig) -> dict[str, tuple]:
    with torch.device("meta"):
        model = build_model(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


# --- public entry points ---------------------------------------------------------------------


@dataclass
class VerifyReport:
    model_dir: Path
    files: list[Path] = field(default_factory=list)
    manifest: Path | None = None
    num_tensors: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        gguf = gguf_weights.is_gguf(self.model_dir)
        lines = [f"model {'file' if gguf else 'dir'}: {self.model_dir}"]
        lines += [f"  weight file: {f.name} ({f.stat().st_size:,} bytes)" for f in self.files]
        if not gguf:     # one GGUF file has no manifest beside it: its sha256 is its own
            manifest = self.manifest.name if self.manifest else "none (not checked)"
            lines.append(f"  sha256 manifest: {manifest}")
        lines.append(f"  tensors: {self.num_tensors}")
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        lines.append("OK" if self.ok else f"FAILED ({len(self.problems)} problem(s))")
        return "\n".join(lines)


def verify_weights(model_dir: str | Path) -> VerifyReport:
    """Run every check and collect all problems (never raises for a bad checkpoint)."""
    model_dir = Path(model_dir)
    if gguf_weights.is_gguf(model_dir):
        return verify_gguf(model_dir)
    report = VerifyReport(model_dir)
    try:
        config = LlamaConfig.from_dir(model_dir)
    except ConfigError as e:
        report.problems.append(str(e))
        return report
    report.files, weight_map, problems = weight_files(model_dir)
    report.problems += problems
    report.manifest = find_manifest(model_dir)
    if report.manifest:
        report.problems += check_manifest(model_dir, report.manifest, report.files)
    found, problems = scan_tensors(report.files, weight_map)
    report.num_tensors = len(found)
    report.problems += problems
    if not report.problems:  # key checks only make sense on a complete, readable set of shards
        report.problems += check_tensors(expected_shapes(config), found, config)
    return report


def _raise_if(problems: list[str]) -> None:
    if problems:
        shown = "; ".join(problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise WeightError(shown + more)


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# CPU flags (as /proc/cpuinfo names them) of native bf16 dot products: AVX-512 BF16's
# vdpbf16ps (Zen 4, Cooper Lake and later Xeons) or AMX tiles (Sapphire Rapids and later)
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags; empty where /proc/cpuinfo does not exist (not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def default_cpu_dtype(flags: frozenset[str]) -> torch.dtype:
    """bf16 where the CPU multiplies it natively (2-8x fp32's GEMM rate, half the bytes per
    decode step; the quality gate passes it on SmolLM2), fp32 elsewhere: without those
    instructions bf16 is converted to fp32 for every product, slower than fp32 itself."""
    return torch.bfloat16 if flags & BF16_CPU_FLAGS else torch.float32


def serving_dtype(dtype: str | None, device: torch.device) -> str | None:
    """The engine's dtype: an explicit one, else on CPU bf16 where the CPU multiplies it
    natively and fp32 elsewhere; None (the checkpoint's, resolve_dtype) on CUDA."""
    if dtype not in (None, "auto") or device.type != "cpu":
        return dtype
    return str(default_cpu_dtype(cpu_flags())).removeprefix("torch.")


def resolve_dtype(dtype: str | torch.dtype | None, config: LlamaConfig,
                  device: str | torch.device) -> torch.dtype:
    """Explicit dtype wins; otherwise fp32 on CPU (exact against transformers' reference: the
    engine picks its own default, serving_dtype), the checkpoint's half type (or bf16) on
    CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        resolved = getattr(torch, _DTYPE_ALIASES.get(str(dtype), str(dtype)), None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ValueError(f"unknown dtype {dtype!r} (use float32, bfloat16 or float16)")
        return resolved
    if torch.device(device).type == "cpu":
        return torch.float32
    return torch.float16 if config.torch_dtype == "float16" else torch.bfloat16


def load_model(model_dir: str | Path, dtype=None, device: str | torch.device = "cpu",
               load_format: str = "mmap"):
    """(model in eval mode on `device`, config); `load_format` is mmap or eager (module doc).
    Raises WeightError or ConfigError."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    model_dir = Path(model_dir)
    if gguf_weights.is_gguf(model_dir):
        return load_gguf(model_dir, dtype, device)
    config = LlamaConfig.from_dir(model_dir)
    files, weight_map, problems = weight_files(model_dir)
    _raise_if(problems)
    if manifest := find_manifest(model_dir):
        _raise_if(check_manifest(model_dir, manifest, files))
    found, problems = scan_tensors(files, weight_map)
    _raise_if(problems)
    torch_dtype = resolve_dtype(dtype, config, device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # safetensors wants an explicit GPU
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.device("meta"):
        model = build_model(config)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    _raise_if(check_tensors(expected, found, config))
    read_shard = _read_mapped if load_format == "mmap" else _read_eagerly
    state = {}
    for path in files:  # one shard at a time; tensors go straight to the target device
        for name, tensor in read_shard(path, device):
            if name in expected:
                state[name] = tensor.to(torch_dtype)    # no copy when the dtype is already right
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # moves the non-persistent RoPE buffer
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    _raise_if([f"tensor {n} was never loaded" for n in still_meta])
    return model.eval().requires_grad_(False), config


def _read_mapped(path: Path, device: torch.device):
    """(name, tensor) of a shard through safetensors' mmap: on CPU, views of the mapping."""
    with safe_open(path, framework="pt", device=str(device)) as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _read_eagerly(path: Path, device: torch.device):
    """(name, tensor) of a shard read whole into memory first: tensors own their bytes."""
    tensors = load_safetensors_bytes(path.read_bytes())    # the file's bytes are freed here
    for name in list(tensors):
        yield name, tensors.pop(name).to(device)    # a CPU copy goes as soon as it is on the GPU


# --- GGUF (one file: metadata, tokenizer, quantized tensors) ---------------------------------


def verify_gguf(path: Path) -> VerifyReport:
    """The file opens, its metadata describes a model we serve, every tensor is there with the
    shape the metadata implies, of a type we read, and dequantizes to finite numbers."""
    report = VerifyReport(path, files=[path] if path.is_file() else [])
    try:
        reader = open_gguf(path)
        report.num_tensors = len(reader.tensors)
        config = gguf_weights.config_from_gguf(reader)
    except (GGUFError, ConfigError) as e:
        report.problems.append(str(e))
        return report
    report.problems += gguf_weights.tensor_problems(reader, expected_shapes(config))
    if not report.problems:
        report.problems += [p for _, _, p in _read_gguf(reader, config) if p]
    return report


def load_gguf(path: Path, dtype, device):
    """(model, config) from a GGUF file: every weight dequantized into `dtype` on `device`."""
    try:
        reader = open_gguf(path)
        config = gguf_weights.config_from_gguf(reader)
    except GGUFError as e:
        raise WeightError(str(e)) from None
    except ConfigError as e:
        raise ConfigError(f"{path.name}: {e.path}", e.reason) from None
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        model = build_model(config)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    _raise_if(gguf_weights.tensor_problems(reader, expected))
    state, rope_freqs = {}, None
    for name, tensor, problem in _read_gguf(reader, config):
        if problem:
            raise WeightError(problem)
        if name == gguf_weights.ROPE_FREQS:
            rope_freqs = tensor
        else:
            state[name] = tensor.to(device=device, dtype=torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)
    if rope_freqs is not None:   # llama.cpp divides each rotation speed by its factor
        rotary = model.model.rotary_emb
        rotary.inv_freq = rotary.inv_freq / rope_freqs.to(rotary.inv_freq.device)
    return model.eval().requires_grad_(False), config


def _read_gguf(reader, config):
    """(name, fp32 tensor, problem or None) per tensor: data that dequantizes to NaN or
    infinity (a damaged file) is named."""
    for gguf_name, name, tensor in gguf_weights.read_tensors(reader, config):
        finite = bool(torch.isfinite(tensor).all())
        yield name, tensor, None if finite else (
            f"tensor {gguf_name} holds NaN or infinite values (a damaged file?)")
