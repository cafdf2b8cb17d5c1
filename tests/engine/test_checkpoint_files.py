"""backend/checkpoint_files.py on its own: which weight files a checkpoint directory has (one
file, or the shards its index lists), and the sha256 manifest written and checked, each fault
named. The files are small byte strings: nothing here reads a tensor."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from prefixgate.backend.checkpoint_files import (
    INDEX_NAME,
    SINGLE_NAME,
    WeightError,
    check_manifest,
    find_manifest,
    sha256_file,
    weight_files,
    write_manifest,
)


def single(tmp_path: Path) -> Path:
    (tmp_path / SINGLE_NAME).write_bytes(b"weights")
    return tmp_path


def sharded(tmp_path: Path, shards=("model-00002-of-00002.safetensors",
                                    "model-00001-of-00002.safetensors")) -> Path:
    weight_map = {f"t{i}": name for i, name in enumerate([*shards, shards[0]])}
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in shards:
        (tmp_path / name).write_bytes(name.encode())
    return tmp_path


def test_one_file(tmp_path):
    assert weight_files(single(tmp_path)) == ([tmp_path / SINGLE_NAME], None, [])


def test_the_index_lists_the_shards_once_each_in_order(tmp_path):
    (tmp_path / SINGLE_NAME).write_bytes(b"ignored: the index wins")
    files, weight_map, problems = weight_files(sharded(tmp_path))
    assert files == [tmp_path / "model-00001-of-00002.safetensors",
                     tmp_path / "model-00002-of-00002.safetensors"]
    assert weight_map == {"t0": "model-00002-of-00002.safetensors",
                          "t1": "model-00001-of-00002.safetensors",
                          "t2": "model-00002-of-00002.safetensors"}
    assert problems == []


def test_a_missing_shard_is_named(tmp_path):
    sharded(tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    files, _, problems = weight_files(tmp_path)
    assert files == [tmp_path / "model-00002-of-00002.safetensors"]
    assert problems == [f"missing shard model-00001-of-00002.safetensors (listed in {INDEX_NAME})"]


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}', "[1, 2]"])
def test_an_unreadable_index_is_named(index, tmp_path):
    (tmp_path / INDEX_NAME).write_text(index)
    files, weight_map, problems = weight_files(tmp_path)
    assert (files, weight_map) == ([], None)
    assert len(problems) == 1 and problems[0].startswith(f"{INDEX_NAME} is unreadable: ")


def test_no_weights_at_all(tmp_path):
    assert weight_files(tmp_path) == (
        [], None, [f"no {SINGLE_NAME} or {INDEX_NAME} in {tmp_path}"])


def test_find_manifest_prefers_sha256sums(tmp_path):
    assert find_manifest(tmp_path) is None
    (tmp_path / "manifest.sha256").write_text("")
    assert find_manifest(tmp_path) == tmp_path / "manifest.sha256"
    (tmp_path / "SHA256SUMS").write_text("")
    assert find_manifest(tmp_path) == tmp_path / "SHA256SUMS"


def test_sha256_file_is_the_files_sha256(tmp_path):
    data = bytes(range(256)) * 4099
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_a_written_manifest_checks_and_sha256sum_agrees(tmp_path):
    sharded(tmp_path)
    manifest = write_manifest(str(tmp_path))
    assert manifest == find_manifest(tmp_path) == tmp_path / "SHA256SUMS"
    files = weight_files(tmp_path)[0]
    assert manifest.read_text() == "".join(
        f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in files)
    assert check_manifest(tmp_path, manifest, files) == []
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "--check", "--quiet", manifest.name], cwd=tmp_path,
                       check=True)


def test_a_changed_byte_is_a_sha256_mismatch(tmp_path):
    manifest = write_manifest(single(tmp_path))
    want = hashlib.sha256(b"weights").hexdigest()
    (tmp_path / SINGLE_NAME).write_bytes(b"weightz")
    got = hashlib.sha256(b"weightz").hexdigest()
    assert check_manifest(tmp_path, manifest, [tmp_path / SINGLE_NAME]) == [
        f"sha256 mismatch for {SINGLE_NAME}: SHA256SUMS says {want}, file has {got}"]


def test_a_listed_file_missing_and_a_weight_file_unlisted(tmp_path):
    single(tmp_path)
    extra = tmp_path / "model-extra.safetensors"
    extra.write_bytes(b"more")
    manifest = tmp_path / "manifest.sha256"
    manifest.write_text(f"{'0' * 64}  gone/tokenizer.json\n")
    assert check_manifest(tmp_path, manifest, [tmp_path / SINGLE_NAME, extra]) == [
        "gone/tokenizer.json is listed in manifest.sha256 but missing",
        f"{SINGLE_NAME} is not listed in manifest.sha256",
        "model-extra.safetensors is not listed in manifest.sha256",
    ]


def test_manifest_lines_sha256sum_writes_are_read(tmp_path):
    """Binary-mode lines (`*`), upper-case digests, comments and blank lines."""
    single(tmp_path)
    digest = hashlib.sha256(b"weights").hexdigest().upper()
    manifest = tmp_path / "SHA256SUMS"
    manifest.write_text(f"# sha256sum -b\n\n{digest} *{SINGLE_NAME}\n")
    assert check_manifest(tmp_path, manifest, [tmp_path / SINGLE_NAME]) == []


@pytest.mark.parametrize("line", [f"{'a' * 64}  /etc/passwd", f"{'a' * 64}  ../outside",
                                  f"{'a' * 63}  {SINGLE_NAME}", f"{'a' * 64}{SINGLE_NAME}"])
def test_a_bad_manifest_line_is_named_by_number(line, tmp_path):
    single(tmp_path)
    digest = hashlib.sha256(b"weights").hexdigest()
    manifest = tmp_path / "SHA256SUMS"
    manifest.write_text(f"{digest}  {SINGLE_NAME}\n{line}\n")
    assert check_manifest(tmp_path, manifest, [tmp_path / SINGLE_NAME]) == [
        f"SHA256SUMS line 2 is not '<sha256>  <relative path>': {line!r}"]


def test_write_manifest_refuses_an_incomplete_checkpoint(tmp_path):
    sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightError, match="missing shard model-00002-of-00002.safetensors"):
        write_manifest(tmp_path)
    assert find_manifest(tmp_path) is None
