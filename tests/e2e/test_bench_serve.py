"""``kvflow bench serve`` end to end against a kvflow server on the tiny Llama: the result JSON,
token counts equal to what the server counted, failures with their error bodies, and the
``--sweep-rates`` PNG."""

from __future__ import annotations

import json
import math

import pytest

from kvflow.bench.serve import LOAD_START_LINE
from kvflow.entrypoints.cli import main
from tests.e2e.test_openai_tiny import MODEL, SERVER_ARGS

STATS = ("mean", "median", "p90", "p99")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def prestart_servers(fixture):
    """This module's server, started ahead (``_prestart_next_module`` in conftest.py) when a
    module runs before this one."""
    return [(fixture("tiny_chat_model"), SERVER_ARGS, None)]


@pytest.fixture(scope="module")
def server(start_server, tiny_chat_model):
    """test_openai_tiny.py's server (``start_server.shared``: the same tiny Llama served as
    "tiny"; every assertion here reads differences of its counters or this run's results)."""
    return start_server.shared(tiny_chat_model, SERVER_ARGS)


def bench(server, tmp_path, name, *args):
    """Run ``kvflow bench serve`` in-process; returns (exit status, result JSON path)."""
    path = tmp_path / f"{name}.json"
    argv = ["bench", "serve", "--base-url", server.url, "--model", MODEL, "--seed", "0",
            "--disable-tqdm", "--result-json", str(path), *args]
    return main(argv), path


def generated_tokens(server):
    return server.value(server.metrics(), "kvflow:generation_tokens_total")


def test_random_completions_json_and_usage(server, tmp_path, tiny_chat_model, capsys):
    before = generated_tokens(server)
    rc, path = bench(server, tmp_path, "random", "--num-prompts", "12", "--input-len", "16",
                     "--output-len", "8", "--ignore-eos", "--request-rate", "30",
                     "--max-concurrency", "6", "--goodput", "ttft:60000", "tpot:60000",
                     "--tokenizer", tiny_chat_model)
    assert rc == 0
    # the load is announced once, before its summary (served_cpu_split.py times from it)
    out = capsys.readouterr().out
    assert out.count(LOAD_START_LINE) == 1
    assert f"{LOAD_START_LINE}: 12 requests at 30.0 req/s\n" in out
    assert out.index(LOAD_START_LINE) < out.index("Benchmark duration (s)")
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["usage_from_server"]) == (12, 0, 12)
    assert r["request_rate"] == 30 and r["max_concurrency"] == 6
    assert r["backend"] == r["endpoint_type"] == "openai"  # vLLM's backend of /v1/completions
    # vLLM's "concurrent": active at some time in one second, not at once (so it can pass 6)
    assert 1 <= r["max_concurrent_requests"] <= 12 and r["max_output_tokens_per_s"] >= 1
    assert r["input_lens"] == [16] * 12 and r["output_lens"] == [8] * 12
    assert r["total_input_tokens"] == 192 and r["total_output_tokens"] == 96
    # the server counted the same tokens (its counter includes the probe's 2)
    assert generated_tokens(server) - before == 96 + 2
    assert r["output_throughput"] == pytest.approx(96 / r["duration"])
    assert r["request_throughput"] == pytest.approx(12 / r["duration"])
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = [r[f"{s}_{name}_ms"] for s in STATS]
        assert all(v > 0 and math.isfinite(v) for v in values), name
        assert r[f"median_{name}_ms"] <= r[f"p99_{name}_ms"]
    assert r["median_ttft_ms"] < r["median_e2e_ms"]
    assert r["good_requests"] == 12 and r["goodput_slos_ms"] == {"ttft": 60000, "tpot": 60000}
    assert len(r["ttfts"]) == 12 and all(len(g) <= 7 for g in r["itls"])


def test_synthetic_chat_counts_match_usage(server, tmp_path):
    before = generated_tokens(server)
    rc, path = bench(server, tmp_path, "chat", "--endpoint", "chat", "--dataset",
                     "synthetic-chat", "--num-prompts", "8", "--num-system-prompts", "2",
                     "--system-len", "uniform:3:6", "--user-len", "uniform:1:4",
                     "--output-len-dist", "uniform:3:6", "--request-rate", "inf")
    assert rc == 0
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["usage_from_server"]) == (8, 0, 8)
    assert all(1 <= n <= 6 for n in r["output_lens"])  # EOS may end a reply early
    assert generated_tokens(server) - before == r["total_output_tokens"] + 2  # + probe
    assert r["request_rate"] == "inf"
    assert r["backend"] == r["endpoint_type"] == "openai-chat"


def test_failures_are_reported_with_error_bodies(server, tmp_path, capsys):
    # prompts longer than --max-model-len (96): the server answers 400; the probe stops the run
    rc, path = bench(server, tmp_path, "fail", "--num-prompts", "2", "--input-len", "300",
                     "--random-vocab-size", "320")
    assert rc == 1 and not path.exists()
    err = capsys.readouterr().err
    assert "probe request failed: HTTP 400" in err and "max_model_len" in err


@pytest.mark.parametrize("args,flag", [
    (["--request-rate", "nan"], "--request-rate"), (["--request-rate", "0"], "--request-rate"),
    (["--sweep-rates", "1,nan"], "--sweep-rates"), (["--sweep-rates", "abc"], "--sweep-rates"),
    (["--goodput", "ttft:nan"], "--goodput"), (["--goodput", "ttft:abc"], "--goodput"),
    (["--max-concurrency", "0"], "--max-concurrency"), (["--burstiness", "0"], "--burstiness"),
    (["--request-timeout", "0"], "--request-timeout"), (["--num-prompts", "-3"], "--num-prompts"),
    (["--input-len", "0"], "--input-len"), (["--output-len", "0"], "--output-len"),
    (["--extra-body", "[1]"], "--extra-body"), (["--extra-body", "{bad"], "--extra-body"),
    (["--compare", "/nonexistent/r.json"], "--compare"),
    (["--dataset", "/nonexistent/w.jsonl"], "--dataset")])
def test_bad_flags_fail_before_any_request(server, tmp_path, capsys, args, flag):
    before = generated_tokens(server)
    rc, path = bench(server, tmp_path, "bad", "--num-prompts", "2", "--input-len", "4",
                     "--output-len", "2", *args)
    assert rc == 2 and not path.exists()
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert generated_tokens(server) == before  # nothing was sent, not even the probe


def test_one_token_outputs_write_null_stats_into_a_new_folder(server, tmp_path):
    path = tmp_path / "new" / "folder" / "r.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--model", MODEL, "--disable-tqdm",
               "--num-prompts", "3", "--input-len", "4", "--output-len", "1",
               "--random-vocab-size", "320", "--result-json", str(path)])
    assert rc == 0

    def no_constants(name):
        raise AssertionError(f"bare {name} in the result JSON")

    r = json.loads(path.read_text(), parse_constant=no_constants)  # strict JSON
    assert r["output_lens"] == [1, 1, 1]
    assert all(r[f"{s}_tpot_ms"] is None for s in STATS)  # no TPOT with one token
    assert all(r[f"{s}_ttft_ms"] > 0 for s in STATS)


def test_sweep_writes_png_and_compares(server, tmp_path):
    common = ["--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--ignore-eos",
              "--random-vocab-size", "320"]
    rc, first = bench(server, tmp_path, "a", *common, "--sweep-rates", "20,inf", "--label", "a")
    assert rc == 0
    doc = json.loads(first.read_text())
    assert doc["label"] == "a" and [r["request_rate"] for r in doc["sweep"]] == [20, "inf"]
    rc, second = bench(server, tmp_path, "b", *common, "--sweep-rates", "inf", "--label", "b",
                       "--compare", str(first))
    assert rc == 0
    for png in (first.with_suffix(".png"), second.with_suffix(".png")):
        data = png.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
        from PIL import Image

        with Image.open(png) as im:
            assert im.format == "PNG" and im.size == (1200, 450)
