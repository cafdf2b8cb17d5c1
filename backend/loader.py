"""Load a Hugging Face checkpoint directory with strict integrity checks.

Weights are treated as download-locked assets. Before a single tensor is read:
  * the shard index (`model.safetensors.index.json`) is compared with the files on disk;
  * an optional sha256 manifest is checked: `SHA256SUMS` (or `manifest.sha256`) in the format
    `sha256sum` writes, one `<64 hex digits>  <path relative to the model dir>` per line; every
    weight file must be listed in it;
  * every tensor name and shape is compared with the model built from config.json.
Any problem raises `WeightError` naming the shard or tensor; no parameter is ever left at random
init (the model is built on the meta device, so an unassigned one could not even run).

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

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors_bytes

from prefixgate.backend.config import LOAD_FORMATS
from prefixgate.backend.models import LlamaConfig, build_model
from prefixgate.common.schema import ConfigError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MANIFEST_NAMES = ("SHA256SUMS", "manifest.sha256")
_MANIFEST_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")
# Tensors some exporters add that carry no weights we need.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightError(Exception):
    """The checkpoint on disk does not match what config.json and the manifest promise."""


# --- checks (each returns a list of readable problems) ---------------------------------------


def weight_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None, list[str]]:
    """(shard paths present, index weight_map or None, problems)."""
    index_path = model_dir / INDEX_NAME
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            return [], None, [f"{INDEX_NAME} is unreadable: {e!r}"]
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        problems = [f"missing shard {n} (listed in {INDEX_NAME})" for n in missing]
        return [model_dir / n for n in names if n not in missing], weight_map, problems
    if (model_dir / SINGLE_NAME).is_file():
        return [model_dir / SINGLE_NAME], None, []
    return [], None, [f"no {SINGLE_NAME} or {INDEX_NAME} in {model_dir}"]


def find_manifest(model_dir: Path) -> Path | None:
    return next((model_dir / n for n in MANIFEST_NAMES if (model_dir / n).is_file()), None)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_manifest(model_dir: Path, manifest: Path, files: list[Path]) -> list[str]:
    """Every listed file exists and hashes to its digest; every weight file is listed."""
    problems, listed = [], {}
    for n, line in enumerate(manifest.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _MANIFEST_LINE.match(line)
        rel = Path(m.group(2)) if m else None
        if rel is None or rel.is_absolute() or ".." in rel.parts:
            problems.append(f"{manifest.name} line {n} is not '<sha256>  <relative path>': "
                            f"{line!r}")
            continue
        listed[rel.as_posix()] = m.group(1).lower()
    for rel, want in listed.items():
        path = model_dir / rel
        if not path.is_file():
            problems.append(f"{rel} is listed in {manifest.name} but missing")
        elif (got := sha256_file(path)) != want:
            problems.append(f"sha256 mismatch for {rel}: {manifest.name} says {want}, "
                            f"file has {got}")
    for f in files:
        if f.relative_to(model_dir).as_posix() not in listed:
            problems.append(f"{f.name} is not listed in {manifest.name}")
    return problems


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
        lines = [f"model dir: {self.model_dir}"]
        lines += [f"  weight file: {f.name} ({f.stat().st_size:,} bytes)" for f in self.files]
        manifest = self.manifest.name if self.manifest else "none (not checked)"
        lines.append(f"  sha256 manifest: {manifest}")
        lines.append(f"  tensors: {self.num_tensors}")
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        lines.append("OK" if self.ok else f"FAILED ({len(self.problems)} problem(s))")
        return "\n".join(lines)


def verify_weights(model_dir: str | Path) -> VerifyReport:
    """Run every check and collect all problems (never raises for a bad checkpoint)."""
    model_dir = Path(model_dir)
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


def resolve_dtype(dtype: str | torch.dtype | None, config: LlamaConfig,
                  device: str | torch.device) -> torch.dtype:
    """Explicit dtype wins; otherwise fp32 on CPU, the checkpoint's half type (or bf16) on CUDA."""
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


def write_manifest(model_dir: str | Path) -> Path:
    """Record the sha256 of every weight file in `SHA256SUMS` (the format `sha256sum -c` reads)."""
    model_dir = Path(model_dir)
    files, _, problems = weight_files(model_dir)
    _raise_if(problems)
    lines = [f"{sha256_file(f)}  {f.relative_to(model_dir).as_posix()}\n" for f in files]
    path = model_dir / MANIFEST_NAMES[0]
    path.write_text("".join(lines))
    return path
