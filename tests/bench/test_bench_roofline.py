"""Roofline bounds for a small config, checked by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvflow.bench.roofline import (
    Machine,
    ModelShape,
    measured_from_json,
    report,
    roofline,
    step_time,
)

# 2 layers, hidden 64, MLP 128, 4 heads / 2 KV heads of 16, vocabulary 100
CONFIG = SimpleNamespace(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=100)


def shape() -> ModelShape:
    return ModelShape.from_hf_config(CONFIG)


def test_counts():
    m = shape()
    # per layer: q/k/v 64*(4+2+2)*16 = 8192, o 4*16*64 = 4096, MLP 3*64*128 = 24576
    assert m.matmul_params() == 2 * (8192 + 4096 + 24576) + 100 * 64 == 80128
    assert m.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2 == 256
    # 3 queries at positions 0..2 attend to 1 + 2 + 3 keys; 4 * layers * heads * head_dim = 512
    assert m.attention_flops(0, 3) == 512 * 6
    assert m.attention_flops(4, 1) == 512 * 5
    no_head_dim = SimpleNamespace(**{**vars(CONFIG), "head_dim": None})
    assert ModelShape.from_hf_config(no_head_dim).head_dim == 16


def test_bounds_by_hand():
    m = shape()
    # TTFT, compute only: 2 * 80128 * 4 + 512 * (1+2+3+4) = 646,144 FLOPs at 1 GFLOP/s
    assert roofline(m, Machine(None, 1e9), 1, 4, 3)["ttft_s"] == pytest.approx(646144e-9)
    # TPOT, memory only: decode steps read weights (160,256 B) + 5 then 6 tokens of KV (256 B)
    tpot = roofline(m, Machine(1e6, None), 1, 4, 3)["tpot_s"]
    assert tpot == pytest.approx((160256 + 5 * 256 + 160256 + 6 * 256) / 2 / 1e6)
    # offline, 2 prompts, both ceilings; every step is memory bound here:
    # prefill 160256 + 2*4*256, decode 160256 + 2*5*256 and 160256 + 2*6*256 bytes
    b = roofline(m, Machine(1e6, 1e9), 2, 4, 3)
    assert b["offline_s"] == pytest.approx((162304 + 162816 + 163328) / 1e6)
    assert b["output_tok_per_s"] == pytest.approx(6 / 0.488448)


def test_compute_bound_when_bandwidth_is_huge():
    b = roofline(shape(), Machine(1e18, 1e9), 1, 4, 2)
    decode_flops = 2 * 80128 + 512 * 5
    assert b["tpot_s"] == pytest.approx(decode_flops / 1e9)


def test_measured_percentages(tmp_path):
    bounds = {"ttft_s": 0.010, "tpot_s": 0.005, "output_tok_per_s": 1000.0}
    lines = report(bounds, {"ttft_s": 0.020, "output_tok_per_s": 250.0})
    assert "50.0% of roofline" in lines[0]
    assert "measured" not in lines[1]
    assert "25.0% of roofline" in lines[2]
    run = {"median_ttft_ms": 20.0, "median_tpot_ms": 8.0, "output_throughput": 300.0,
           "num_prompts": 8, "completed": 8, "total_input_tokens": 256,
           "total_output_tokens": 128, "request_rate": 4.0}
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps(run))
    got = measured_from_json(str(serve))
    assert {k: got[k] for k in ("ttft_s", "tpot_s", "output_tok_per_s", "num_prompts",
                                "input_len", "output_len")} == {
        "ttft_s": 0.02, "tpot_s": 0.008, "output_tok_per_s": 300.0, "num_prompts": 8,
        "input_len": 32, "output_len": 16}
    # a sweep: the highest-throughput run; a TPOT written as null (one-token outputs) is left out
    sweep = tmp_path / "sweep.json"
    fast = {**run, "output_throughput": 500.0, "median_tpot_ms": None, "request_rate": "inf"}
    sweep.write_text(json.dumps({"label": "x", "sweep": [run, fast]}))
    got = measured_from_json(str(sweep))
    assert got["output_tok_per_s"] == 500.0 and "tpot_s" not in got and "inf" in got["source"]
    thr = tmp_path / "thr.json"
    thr.write_text(json.dumps([{"output_tokens_per_s": 123.0, "num_prompts": 64,
                                "input_len": 128, "output_len": 64}]))
    got = measured_from_json(str(thr))
    assert (got["output_tok_per_s"], got["num_prompts"], got["output_len"]) == (123.0, 64, 64)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(ValueError, match="--measured-json"):
            measured_from_json(str(path))


def test_bound_is_per_operation_not_per_step():
    """Linear layers compute-bound, attention bandwidth-bound in the same step: the step
    takes the sum of the two, not the max over the step's totals (the issue-20 correction)."""
    m, hw = shape(), Machine(1e6, 1e7)
    # decode step of 64 sequences at context 5 (query at position 4)
    linear_flops, weight_bytes = 64 * 2 * 80128, 80128 * 2  # 1.0256 s compute > 0.16 s bytes
    attn_flops, kv_bytes = 64 * 512 * 5, 64 * 5 * 256  # 0.0164 s compute < 0.0819 s bytes
    got = step_time(m, hw, 64, attn_flops, kv_bytes, 2)
    assert got == pytest.approx(linear_flops / 1e7 + kv_bytes / 1e6)
    per_step = max((linear_flops + attn_flops) / 1e7, (weight_bytes + kv_bytes) / 1e6)
    assert got > per_step * 1.05
    # a whole decode: one step per output token after the first
    b = roofline(m, hw, 64, 4, 2)
    assert b["offline_s"] - roofline(m, hw, 64, 4, 1)["offline_s"] == pytest.approx(got)


def test_h200_llama_8b_decode_floor():
    """GPU-W1 on the Llama-3.1-8B shape at 780 TFLOP/s and 4.2 TB/s (issue 20): a decode step
    at batch 256 and ~576 tokens of context is ~9.5 ms (linear layers 4.9 ms compute-bound,
    attention 4.6 ms of K/V reads), not the ~8.2 ms of the per-step max."""
    llama = SimpleNamespace(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            vocab_size=128256)
    m, hw = ModelShape.from_hf_config(llama), Machine(4.2e12, 780e12)
    assert m.matmul_params() == 7_504_658_432  # the embedding table is a lookup, not counted
    kv = 256 * 576 * m.kv_bytes_per_token(2)
    assert kv / 4.2e12 == pytest.approx(4.60e-3, rel=1e-2)  # ~19 GB of K/V
    step = step_time(m, hw, 256, 256 * m.attention_flops(575, 1), kv, 2)
    assert step == pytest.approx(2 * 7_504_658_432 * 256 / 780e12 + kv / 4.2e12)
    assert step == pytest.approx(9.53e-3, rel=1e-2)
    assert roofline(m, hw, 256, 512, 128)["output_tok_per_s"] == pytest.approx(8727, rel=1e-2)


def test_cli_bounds_the_overridden_shape(tmp_path, capsys):
    """``--hf-overrides`` reaches the shape bounded (as ``kvflow serve`` would build the
    model): 1 layer instead of 2 drops one layer's 36,864 parameters (above); a bad JSON is
    exit status 2 naming the flag."""
    import transformers

    from kvflow.entrypoints.cli import main

    config = transformers.LlamaConfig(**{k: v for k, v in vars(CONFIG).items()},
                                      max_position_embeddings=64, tie_word_embeddings=False)
    config.save_pretrained(tmp_path)

    def params(*extra: str) -> int:
        assert main(["bench", "roofline", "--model", str(tmp_path), *extra]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines()
                    if x.startswith("matmul parameters"))
        return int(line.split()[2].replace(",", ""))

    assert params() == 80128
    assert params("--hf-overrides", '{"num_hidden_layers": 1}') == 80128 - 36864
    assert main(["bench", "roofline", "--model", str(tmp_path), "--hf-overrides", "[1"]) == 2
    assert "--hf-overrides" in capsys.readouterr().err
