"""The speculative-decoding benchmark runs end to end (tiny model, --quick) and saves its JSON."""
import json

from prefixgate.backend.bench import speculative as bench_spec_decode
from prefixgate.backend.spec_decode import StepCost


def _keep_engines(monkeypatch) -> list:
    """The (baseline, spec) engines the benchmark builds, kept for a look after its run."""
    built = []
    build = bench_spec_decode.build_engines

    def keeping(*args, **kw):
        built.append(build(*args, **kw))
        return built[-1]

    monkeypatch.setattr(bench_spec_decode, "build_engines", keeping)
    return built


def test_bench_spec_decode_quick_run_saves_cells(tmp_path, capsys, monkeypatch, model):
    built = _keep_engines(monkeypatch)
    out = tmp_path / "spec.json"
    argv = ["--quick", "--model", str(model), "--device", "cpu", "--out", str(out)]
    assert bench_spec_decode.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["config"]["speculative_config"] == bench_spec_decode.DEFAULT_SPEC
    cells = {(c["workload"], c["batch"]): c for c in data["cells"]}
    assert set(cells) == {(w, b) for w in ("quoting", "free") for b in (1, 16)}
    for c in cells.values():
        for arm in ("baseline", "spec"):
            assert c[arm]["decode_tok_per_s"] > 0 and c[arm]["tpot_p50_s"] > 0
        assert c["ratio"] > 0 and c["rounds"] == 1
        assert c["mean_acceptance_length"] >= 1 and 0 <= c["acceptance_rate"] <= 1
        assert c["same_output_fraction"] is not None           # greedy both: comparable
    assert set(data["targets"]) == {"quoting_b1", "free_b1", "free_b16"}
    assert data["selection"]["candidates"] == 12
    printed = capsys.readouterr().out
    assert "quoting      1" in printed and "free        16" in printed
    assert "(b) free, batch 16" in printed and ("PASS" in printed or "FAIL" in printed)
    # the engine's own gates: no batch cap, the 0.1 floor, and the cost fit it timed itself
    (base, spec), = built
    assert base.speculator is None
    assert spec.speculator.config.disable_by_batch_size is None
    assert spec.speculator.config.min_acceptance_rate == 0.1
    assert type(spec.speculator.cost) is StepCost and spec.speculator.cost.sums[0] >= 8
    assert spec.spec_stats()["num_drafts"] > 0


def test_bench_spec_decode_sweep_turns_the_gates_off(tmp_path, capsys, monkeypatch, model):
    built = _keep_engines(monkeypatch)
    out = tmp_path / "sweep.json"
    assert bench_spec_decode.main(["--quick", "--sweep", "--batches", "1,4", "--model", str(model),
                                   "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    cfg = data["config"]["speculative_config"]
    assert cfg["min_acceptance_rate"] == 0 and cfg["disable_by_batch_size"] >= 1 << 20
    assert set(data["sweep"]["by_batch"]) == {"1", "4"}
    assert data["targets"] == {}
    assert "sweep (gates off)" in capsys.readouterr().out
    # ... the break-even bar too: whatever the steps took, no sequence had a bar to reach
    (_, spec), = built
    assert spec.spec_stats()["num_drafts"] > 0
    assert all(spec.speculator.bar(b) == 0.0 for b in (1, 4, 16, 64, 1 << 20))


def test_rag_workloads_quote_documents_through_the_chat_template():
    from prefixgate.backend.bench.chat_workloads import DOCUMENTS, chat_prompts
    from prefixgate.backend.config import resolve_model
    from prefixgate.common.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2"))
    rag, chat = (chat_prompts(tok, kind, 5, seed=0) for kind in ("rag", "chat"))
    assert len(rag) == len(chat) == 5 and len({tuple(p) for p in rag + chat}) == 10
    assert chat_prompts(tok, "rag", 5, seed=0) == rag                  # reproducible
    for ids in rag:
        text = tok.decode(ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\nAnswer the user's question using only")
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert all(f"Document {i}:\n" in text for i in range(1, DOCUMENTS + 1))
        # the question names a document by the words it begins with
        question = text.rsplit("<|im_start|>user\n", 1)[1]
        n, start = int(question.split("document ")[1][0]), question.split('"')[1]
        assert text.split(f"Document {n}:\n")[1].startswith(start)
    for ids in chat:
        text = tok.decode(ids, skip_special_tokens=False)
        assert "Document" not in text and text.count("<|im_start|>") == 3   # default system turn
    assert bench_spec_decode.default_workloads("smollm2") == "rag"


def test_bench_spec_decode_rag_workloads_run_end_to_end(tmp_path, capsys, model):
    out = tmp_path / "rag.json"
    argv = ["--quick", "--workloads", "rag", "--batches", "1,2", "--model", str(model),
            "--device", "cpu", "--out", str(out)]
    assert bench_spec_decode.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["config"]["workloads"] == "rag"
    assert data["selection"]["quoting_prompts"] == data["selection"]["free_prompts"] == 2
    cells = {(c["workload"], c["batch"]) for c in data["cells"]}
    assert cells == {(w, b) for w in ("quoting", "free") for b in (1, 2)}
    assert all(c["same_output_fraction"] is not None for c in data["cells"])
    assert "RAG prompts" in capsys.readouterr().out
    # a directory model (the demo's random weights, this tiny one) keeps the selected workloads
    assert bench_spec_decode.default_workloads(str(model)) == "selected"
