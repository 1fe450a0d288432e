"""``kvflow bench latency`` on the tiny Llama: one row per batch size, and its JSON feeds
``bench roofline --measured-json``."""

from __future__ import annotations

import json

from kvflow.bench.roofline import measured_from_json
from kvflow.entrypoints.cli import main


def test_latency_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", tiny_llama.path, "--batch-sizes", "1,3",
               "--input-len", "8", "--output-len", "4", "--num-iters", "1", "--dtype",
               "float32", "--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4",
               "--output-json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [b["batch_size"] for b in doc["batches"]] == [1, 3]
    for b in doc["batches"]:
        assert b["ttft_s"] > 0 and b["e2e_s"] > 0  # no ordering: a loaded CPU is noisy
        assert b["output_tok_per_s"] == b["batch_size"] * 4 / b["e2e_s"]
    assert "TTFT ms" in capsys.readouterr().out
    measured = measured_from_json(str(out))
    assert measured["ttft_s"] == doc["batches"][0]["ttft_s"]
    assert measured["output_tok_per_s"] == max(b["output_tok_per_s"] for b in doc["batches"])


def test_latency_rejects_bad_batch_sizes(capsys):
    assert main(["bench", "latency", "--batch-sizes", "0", "--model", "x"]) == 2
    assert "batch-sizes" in capsys.readouterr().err


def test_prompt_plus_output_beyond_max_model_len_is_refused(tiny_llama, capsys):
    """8 + 12 tokens in a 16-token context: generation stopped at 8 tokens and latency
    divided by 11 gaps that never happened (TPOT, out tok/s wrong), throughput ended in a
    RuntimeError traceback. Now status 2 naming both flags, before any timed run."""
    common = ["--model", tiny_llama.path, "--input-len", "8", "--output-len", "12",
              "--max-model-len", "16", "--dtype", "float32", "--device", "cpu",
              "--num-kv-blocks", "64", "--block-size", "4"]
    for command in (["latency", "--batch-sizes", "1"], ["throughput", "--num-prompts", "1"]):
        assert main(["bench", *command, *common]) == 2
        err = capsys.readouterr().err
        assert err.endswith("kvflow: error: --input-len 8 + --output-len 12 = 20 tokens exceed "
                            "the engine's max_model_len 16: lower them or raise "
                            "--max-model-len\n"), err
