"""A Hugging Face checkpoint directory's weight files and their sha256 manifest.

The files: one `model.safetensors`, or the shards `model.safetensors.index.json` lists, each
checked to be on disk. The manifest, `SHA256SUMS` (or `manifest.sha256`), is what `sha256sum`
writes: one `<64 hex digits>  <path relative to the model dir>` per line; every weight file must
be listed in it, and every listed file must hash to its digest. The loader checks both before a
tensor is read; the demo model's build writes the manifest.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MANIFEST_NAMES = ("SHA256SUMS", "manifest.sha256")
_MANIFEST_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


class WeightError(Exception):
    """The checkpoint on disk does not match what config.json and the manifest promise."""


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


def write_manifest(model_dir: str | Path) -> Path:
    """Record the sha256 of every weight file in `SHA256SUMS` (the format `sha256sum -c` reads)."""
    model_dir = Path(model_dir)
    files, _, problems = weight_files(model_dir)
    if problems:
        raise WeightError("; ".join(problems))
    lines = [f"{sha256_file(f)}  {f.relative_to(model_dir).as_posix()}\n" for f in files]
    path = model_dir / MANIFEST_NAMES[0]
    path.write_text("".join(lines))
    return path
