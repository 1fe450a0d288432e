"""Roofline bounds for a small config, checked by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvflow.bench.roofline import Machine, ModelShape, measured_from_json, report, roofline

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
