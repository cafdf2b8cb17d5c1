"""Loader integrity: good checkpoints load exactly; every kind of damage is an error naming it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixgate.backend.cli import verify_weights_main as main
from prefixgate.backend.loader import WeightError, load_model, verify_weights
from tests.engine.helpers import PagedCache
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def pristine_sharded(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "sharded", "qwen2",
                           max_shard_size="100KB")


@pytest.fixture
def model_dir(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "m")


@pytest.fixture
def sharded_dir(pristine_sharded, tmp_path):
    return shutil.copytree(pristine_sharded, tmp_path / "s")


def _rewrite(path, change):
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _write_manifest(model_dir):
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    out = subprocess.run(["sha256sum", *files], cwd=model_dir, capture_output=True, text=True,
                         check=True)
    (model_dir / "SHA256SUMS").write_text(out.stdout)


def test_good_checkpoint_loads_every_tensor_exactly(model_dir, capsys):
    model, config = load_model(model_dir)
    on_disk = load_file(model_dir / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(state[name], tensor), name
    assert not any(p.is_meta or p.requires_grad for p in model.parameters())
    assert config.num_hidden_layers == 2
    assert main([str(model_dir)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")


def test_load_model_casts_to_requested_dtype(model_dir):
    for name in ("bfloat16", "bf16", torch.bfloat16):
        model, _ = load_model(model_dir, dtype=name)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(model_dir, dtype="int8")


def test_manifest_passes_then_catches_corrupted_bytes(model_dir, capsys):
    _write_manifest(model_dir)
    load_model(model_dir)
    assert verify_weights(model_dir).ok
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside tensor data: the header still parses, only the hash can tell
    path.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="sha256 mismatch for model.safetensors"):
        load_model(model_dir)
    assert main([str(model_dir)]) == 1
    assert "PROBLEM: sha256 mismatch for model.safetensors" in capsys.readouterr().out


def test_write_manifest_is_sha256sum_compatible(sharded_dir, capsys):
    assert main([str(sharded_dir), "--write-manifest"]) == 0
    assert "wrote" in capsys.readouterr().out
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=sharded_dir,
                           capture_output=True, text=True)
    shards = list(sharded_dir.glob("*.safetensors"))
    assert check.returncode == 0 and check.stdout.count(": OK") == len(shards)
    assert verify_weights(sharded_dir).manifest.name == "SHA256SUMS"
    load_model(sharded_dir)


def test_manifest_must_cover_every_weight_file(sharded_dir):
    _write_manifest(sharded_dir)
    lines = (sharded_dir / "SHA256SUMS").read_text().splitlines()
    dropped = lines[0].split()[-1]
    (sharded_dir / "SHA256SUMS").write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(WeightError, match=f"{dropped} is not listed in SHA256SUMS"):
        load_model(sharded_dir)


def test_manifest_rejects_paths_outside_the_model_dir(model_dir):
    (model_dir / "manifest.sha256").write_text(f"{'0' * 64}  ../etc/passwd\n")
    with pytest.raises(WeightError, match="manifest.sha256 line 1"):
        load_model(model_dir)


def test_sharded_checkpoint_loads_and_matches_transformers(sharded_dir):
    from transformers import AutoModelForCausalLM

    shards = sorted(sharded_dir.glob("model-*.safetensors"))
    assert len(shards) >= 3, "max_shard_size should have split the checkpoint"
    model, _ = load_model(sharded_dir)
    hf = AutoModelForCausalLM.from_pretrained(sharded_dir)
    ours, theirs = model.state_dict(), hf.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_missing_shard_is_named(sharded_dir):
    victim = sorted(sharded_dir.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(WeightError, match=f"missing shard {victim.name}"):
        load_model(sharded_dir)
    report = verify_weights(sharded_dir)
    assert not report.ok and any(victim.name in p for p in report.problems)


def test_tensor_in_wrong_shard_per_index_is_an_error(sharded_dir):
    index_path = sharded_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    by_shard = {}
    for n, s in index["weight_map"].items():
        by_shard.setdefault(s, []).append(n)
    # Move one tensor of a multi-tensor shard, so every shard stays listed in the index.
    home = next(s for s, names in by_shard.items() if len(names) > 1)
    name, other = by_shard[home][0], next(s for s in by_shard if s != home)
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(WeightError, match=f"tensor {name} is in {home}, but .* says {other}"):
        load_model(sharded_dir)


def test_missing_tensor_is_named(model_dir):
    _rewrite(model_dir / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_model(model_dir)
    assert main([str(model_dir)]) == 1


def test_unexpected_tensor_is_named(model_dir):
    _rewrite(model_dir / "model.safetensors",
             lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightError,
                       match="unexpected tensor model.layers.0.self_attn.extra.weight"):
        load_model(model_dir)


def test_wrong_shape_is_named(model_dir):
    _rewrite(model_dir / "model.safetensors",
             lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(WeightError, match=r"shape mismatch for model.norm.weight .*\[63\].*\[64\]"):
        load_model(model_dir)


def test_truncated_file_is_named(model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(WeightError, match="model.safetensors is not a readable safetensors file"):
        load_model(model_dir)


def test_no_weights_at_all(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(WeightError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(model_dir)


def test_tied_embeddings_have_no_head_parameter(tmp_path):
    d = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(d / "model.safetensors")
    model, config = load_model(d)
    assert config.tie_word_embeddings and model.lm_head is None
    hidden = torch.randn(3, config.hidden_size)
    expected = hidden @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_verify_weights_command_line(model_dir):
    """`prefixgate verify-weights DIR` end to end: report on stdout, exit status 0 / 1."""
    exe = Path(sys.executable).parent / "prefixgate"
    if not exe.exists():
        pytest.skip("prefixgate console script not installed")
    good = subprocess.run([str(exe), "verify-weights", str(model_dir)], capture_output=True,
                          text=True)
    assert good.returncode == 0 and good.stdout.rstrip().endswith("OK"), good.stderr
    config = model_dir / "config.json"
    config.write_text(config.read_text().replace('"num_hidden_layers": 2',
                                                 '"num_hidden_layers": 3'))
    bad = subprocess.run([str(exe), "verify-weights", str(model_dir)], capture_output=True,
                         text=True)
    assert bad.returncode == 1
    assert "PROBLEM: missing tensor model.layers.2.self_attn.q_proj.weight" in bad.stdout


# --- load formats: --load-format mmap | eager ------------------------------------------------


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """This process's memory mappings of `path` (Linux /proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def _file_backed(model, path: Path) -> list[bool]:
    """Per parameter: whether its data lies in a mapping of `path`."""
    ranges = _mapped_ranges(path.resolve())
    return [any(a <= p.data_ptr() < b for a, b in ranges) for p in model.parameters()]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_mmap_keeps_cpu_weights_in_the_file_mapping_and_eager_reads_them_into_memory(model_dir):
    weights = model_dir / "model.safetensors"
    mapped, _ = load_model(model_dir, load_format="mmap")
    assert all(_file_backed(mapped, weights))
    eager, _ = load_model(model_dir, load_format="eager")
    assert not any(_file_backed(eager, weights))
    converted, _ = load_model(model_dir, dtype="bfloat16", load_format="mmap")
    assert not any(_file_backed(converted, weights))    # a dtype conversion copies either way


@pytest.fixture(scope="module")
def demo_dir():
    from prefixgate.backend.demo import ensure_demo_model

    return Path(ensure_demo_model())


@pytest.mark.parametrize("which,dtype", [("pristine", None), ("pristine", "bfloat16"),
                                         ("pristine_sharded", None), ("demo_dir", None)])
def test_both_load_formats_give_identical_weights_and_logits(which, dtype, request):
    path = request.getfixturevalue(which)
    (mapped, config), (eager, _) = (load_model(path, dtype=dtype, load_format=f)
                                    for f in ("mmap", "eager"))
    ours, theirs = mapped.state_dict(), eager.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in ours)
    prompt = [5, 17, 33, 61, 90, 120, 150, 200, 7, 8, 9]
    dt = next(mapped.parameters()).dtype
    logits = [PagedCache(config, dtype=dt).step(m, {0: prompt})[0] for m in (mapped, eager)]
    assert torch.equal(*logits)


def test_an_unknown_load_format_is_refused(model_dir, capsys):
    from prefixgate.backend.cli import build_parser, engine_args

    with pytest.raises(ValueError, match="load format 'bogus': use one of mmap, eager"):
        load_model(model_dir, load_format="bogus")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--load-format", "bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--load-format: invalid choice: 'bogus'" in err
    assert engine_args(build_parser().parse_args(["--load-format", "eager"])).load_format == "eager"
    assert engine_args(build_parser().parse_args([])).load_format == "mmap"
