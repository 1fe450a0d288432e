"""Flag checks of the ``kvflow bench`` commands: bad values exit with status 2 and a message
naming the flag before any model is loaded (the model given here does not exist, so loading
it would fail differently), and the probe never repeats a measured prompt."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from kvflow.bench import serve
from kvflow.bench.checks import ensure_parent_dir
from kvflow.bench.client import RequestResult
from kvflow.bench.datasets import BenchRequest
from kvflow.bench.serve_checks import load_compare
from kvflow.entrypoints.cli import main

NO_MODEL = "/nonexistent/model"


@pytest.mark.parametrize("argv,flag", [
    (["throughput", "--num-prompts", "0"], "--num-prompts"),
    (["throughput", "--input-len", "-1"], "--input-len"),
    (["throughput", "--compare", "hf", "--hf-batch-size", "0"], "--hf-batch-size"),
    (["latency", "--batch-sizes", "a,b"], "--batch-sizes"),
    (["latency", "--batch-sizes", "1,0"], "--batch-sizes"),
    (["latency", "--num-iters", "0"], "--num-iters"),
    (["latency", "--output-len", "1"], "--output-len"),
    (["roofline", "--bandwidth", "-5"], "--bandwidth"),
    (["roofline", "--flops", "nan"], "--flops"),
    (["roofline", "--output-len", "0"], "--output-len"),
    (["roofline", "--measured-tpot-ms", "-3"], "--measured-tpot-ms"),
    (["roofline", "--measured-json", "/nonexistent/r.json"], "--measured-json"),
    (["throughput", "--data-parallel-size", "2"], "--data-parallel-size 2"),
    # HF would run the float weights: the ratio would compare two different models
    (["throughput", "--compare", "hf", "--quantization", "int8"],
     ("--compare hf runs the checkpoint's weights unquantized: it cannot be compared "
      "against --quantization int8")),
    (["latency", "--data-parallel-size", "2"], "--data-parallel-size 2"),
    (["perplexity", "--data-parallel-size", "2"], "--data-parallel-size 2"),
    (["serve", "--seed", "-1"], "--seed must be >= 0"),
    # numpy's legacy generator (vLLM's, for the arrival gaps) takes seeds below 2**32
    (["serve", "--seed", str(2**32)], "--seed must be <= 4294967295"),
    (["serve", "--seed", str(2**32 - 2), "--sweep-rates", "1,2,4"],
     "--seed must be <= 4294967293"),
    (["serve", "--request-rate", "4", "--sweep-rates", "1,2"],
     "give --request-rate (one run) or --sweep-rates (one run per rate), not both"),
    # an empty list (e.g. an unset shell variable) is no sweep: refused, not one default run
    (["serve", "--sweep-rates", ""], "bad --sweep-rates ''"),
    (["serve", "--goodput", "ttft:50", "ttft:80"], "the ttft SLO is given twice"),
    (["throughput", "--seed", "-1"], "--seed must be >= 0"),
    (["latency", "--seed", "-1"], "--seed must be >= 0"),
    (["serve", "--random-vocab-size", "3"], "--random-vocab-size must be >= 4"),
    (["serve", "--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1), got 1.0"),
    (["serve", "--random-prefix-len", "-2"], "--random-prefix-len must be >= 0"),
    (["serve", "--input-len", "1", "--random-range-ratio", "0.5"],
     "--input-len 1 with --random-range-ratio 0.5 can draw an empty prompt"),
    (["serve", "--dataset", "synthetic-chat", "--random-prefix-len", "4"],
     "--random-prefix-len applies to --dataset random only"),
    (["serve", "--dataset", "synthetic-chat", "--num-system-prompts", "0"],
     "--num-system-prompts must be >= 1"),
    (["serve", "--dataset", "synthetic-chat", "--user-len", "uniform:50:10"],
     "--user-len: bad length distribution 'uniform:50:10': need 0 <= LOW <= HIGH"),
    (["serve", "--dataset", "synthetic-chat", "--system-len", "uniform:-5:-1"],
     "--system-len: bad length distribution"),
    (["serve", "--dataset", "synthetic-chat", "--output-len-dist", "uniform:0:0"],
     "--output-len-dist 'uniform:0:0': LOW must be >= 1"),
    (["serve", "--dataset", "synthetic-chat", "--user-len", "lognormal:0:1:1:10"],
     "a lognormal MEAN must be > 0"),
    (["serve", "--dataset", "synthetic-chat", "--user-len", "normal:5:-1:1:10"],
     "STD a number >= 0")])
def test_bad_flags_exit_2_before_loading(capsys, argv, flag):
    assert main(["bench", *argv, "--model", NO_MODEL]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


@pytest.mark.parametrize("url, why", [
    ("notaurl", "not an http(s) URL with a host"),
    ("localhost:8000", "not an http(s) URL with a host"),
    ("http:///v1", "not an http(s) URL with a host"),
    ("http://127.0.0.1:99999", "not a URL (Port out of range 0-65535)"),
])
def test_malformed_base_url_is_2_unreachable_is_1(capsys, url, why):
    """A malformed --base-url is bad input (status 2, before any request); a well-formed URL
    where no server answers fails at the probe request (status 1)."""
    assert main(["bench", "serve", "--model", NO_MODEL, "--base-url", url]) == 2
    err = capsys.readouterr().err
    assert err == f"kvflow: error: --base-url {url!r}: {why}" + (
        "; give the server's root, e.g. http://127.0.0.1:8000\n" if "host" in why else "\n")
    assert main(["bench", "serve", "--model", NO_MODEL, "--base-url", "http://127.0.0.1:9",
                 "--random-vocab-size", "100", "--num-prompts", "1"]) == 1
    assert "probe request failed" in capsys.readouterr().err


@pytest.mark.parametrize("dataset", ["random", "jsonl"])
def test_tokenizer_that_does_not_load_is_named(tmp_path, capsys, dataset):
    """A --tokenizer no tokenizer loads from: status 2 and one line naming the flag and why,
    before any request (it fell back silently to a 32000-token vocabulary and chunk counts;
    here the request would fail with status 1, no server answering)."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi", "output_len": 2}\n')
    flags = ["--random-vocab-size", "100"] if dataset == "random" else ["--dataset", str(path)]
    assert main(["bench", "serve", "--model", NO_MODEL, "--tokenizer", str(tmp_path),
                 "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvflow: error: --tokenizer {tmp_path}: no tokenizer loads from it "
                          f"(Model directory '{tmp_path}' has no config.json") and \
        err.count("\n") == 1, err


def _result(**drop: bool) -> dict:
    run = {"label": "other", "output_throughput": 50.0, "median_ttft_ms": 20.0,
           "p99_ttft_ms": 40.0, "median_tpot_ms": 5.0, "p99_tpot_ms": None}
    return {k: v for k, v in run.items() if k not in drop}


@pytest.mark.parametrize("content, why", [
    ("", "--dataset {path}: the file holds no requests (only blank lines)"),
    ("\n  \n", "--dataset {path}: the file holds no requests (only blank lines)"),
], ids=["empty", "blank"])
def test_empty_dataset_file_is_named(tmp_path, capsys, content, why):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    assert main(["bench", "serve", "--model", NO_MODEL, "--dataset", str(path)]) == 2
    assert capsys.readouterr().err == f"kvflow: error: {why.format(path=path)}\n"


@pytest.mark.parametrize("doc, why", [
    ([1, 2], "a JSON list, not an object"),
    (5, "a JSON int, not an object"),
    ({"sweep": []}, '"sweep" is not a list of runs'),
    ({"sweep": [_result(), "x"]}, "run 1 has no numeric output_throughput"),
    ({"sweep": [_result(p99_ttft_ms=True)]}, "run 0 lacks p99_ttft_ms"),
    (_result(median_tpot_ms=True, p99_tpot_ms=True), "run 0 lacks median_tpot_ms, p99_tpot_ms"),
])
def test_compare_file_that_is_not_a_result(tmp_path, capsys, doc, why):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(doc))
    assert main(["bench", "serve", "--model", NO_MODEL, "--compare", str(path)]) == 2
    assert capsys.readouterr().err == (f"kvflow: error: --compare {path}: not a kvflow bench "
                                       f"serve result ({why})\n")


def test_compare_result_without_label_is_labelled_by_its_file(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"sweep": [_result(label=True)]}))
    assert load_compare(str(path)) == (str(path), [_result(label=True)])
    path.write_text(json.dumps(_result()))
    assert load_compare(str(path)) == ("other", [_result()])


def test_probe_reverses_chat_messages(monkeypatch):
    sent: list[BenchRequest] = []

    async def fake_run_load(requests, args, rate):
        sent.extend(requests)
        return [RequestResult(success=True)], 0.0

    monkeypatch.setattr(serve, "run_load", fake_run_load)
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "hello"}]
    first = BenchRequest("abc\nhello", 0, 50, messages)
    asyncio.run(serve.probe([first], argparse.Namespace(max_concurrency=None)))
    assert [m["content"] for m in sent[0].messages] == ["cba", "olleh"]
    assert sent[0].output_len == 2 and first.messages[1]["content"] == "hello"  # untouched


def test_output_paths_checked_before_a_run(tmp_path):
    ensure_parent_dir(str(tmp_path / "new" / "r.json"), "--result-json")
    assert (tmp_path / "new").is_dir()
    with pytest.raises(ValueError, match="--result-json .*is a folder"):
        ensure_parent_dir(str(tmp_path), "--result-json")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile is not a folder"):
        ensure_parent_dir(str(tmp_path / "afile" / "r.json"), "--output-json")


def test_latency_output_json_folder_fails_before_loading(tmp_path, capsys):
    assert main(["bench", "latency", "--model", NO_MODEL, "--output-json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_random_range_ratio_and_prefix_reach_the_requests(monkeypatch, tmp_path):
    """vLLM's --random-range-ratio and --random-prefix-len shape the sent requests and are
    recorded in the result."""
    sent = _record_loads(monkeypatch)
    out = tmp_path / "r.json"
    assert main(["bench", "serve", "--model", NO_MODEL, "--random-vocab-size", "1000",
                 "--num-prompts", "64", "--input-len", "8", "--output-len", "10",
                 "--random-range-ratio", "0.5", "--random-prefix-len", "2",
                 "--result-json", str(out), "--disable-tqdm"]) == 0
    reqs = sent[1]  # after the probe
    # prompts: 2 + [4, 12] ids, the first 2 shared; outputs: [5, 15] tokens
    assert {r.prompt_len for r in reqs} <= set(range(6, 15)) and len(
        {r.prompt_len for r in reqs}) > 3
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert len({tuple(r.prompt[:2]) for r in reqs}) == 1
    assert {r.output_len for r in reqs} <= set(range(5, 16))
    r = json.loads(out.read_text())
    assert (r["random_range_ratio"], r["random_prefix_len"]) == (0.5, 2)


def test_sweep_draws_new_prompts_per_rate(monkeypatch, tmp_path, capsys):
    """Each rate of a sweep after the first draws its random prompts with --seed + i: the
    same prompts again were served from the prefix cache (on a tiny-model kvflow server the
    second of two equal rates had 72 of its 96 prompt tokens cached and half the TTFT)."""
    sent = _record_loads(monkeypatch)
    monkeypatch.setattr("kvflow.bench.plot.plot_sweeps", lambda runs, path: None)
    out = tmp_path / "s.json"
    argv = ["bench", "serve", "--model", NO_MODEL, "--random-vocab-size", "1000",
            "--num-prompts", "4", "--input-len", "8", "--seed", "5", "--sweep-rates", "inf,inf",
            "--result-json", str(out), "--disable-tqdm"]
    assert main(argv) == 0
    _probe, first, second = sent
    firsts = {tuple(r.prompt[:4]) for r in first}
    assert firsts.isdisjoint(tuple(r.prompt[:4]) for r in second)
    assert [r.prompt for r in first] == [r.prompt for r in serve.build_requests(
        argparse.Namespace(dataset="random", random_vocab_size=1000, num_prompts=4, input_len=8,
                           output_len=64, seed=5, endpoint="completions",
                           random_range_ratio=0.0, random_prefix_len=0), lambda: None)]
    assert [run["seed"] for run in json.loads(out.read_text())["sweep"]] == [5, 6]
    # a ShareGPT file is resampled per rate too (conversations reshuffled with seed + i)
    sent.clear()
    convs = [{"conversations": [{"from": "human", "value": f"{i} {i} {i} {i} {i}"},
                                {"from": "gpt", "value": "a b c d e"}]} for i in range(40)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    monkeypatch.setattr(serve, "make_tokenizer_factory", lambda *a: lambda: _WordTokenizer())
    argv[argv.index("--random-vocab-size"):argv.index("--seed")] = [
        "--dataset", str(tmp_path / "sg.json"), "--num-prompts", "3"]
    assert main(argv) == 0
    assert {r.prompt for r in sent[1]}.isdisjoint(r.prompt for r in sent[2])


class _WordTokenizer:
    """One token per word (a ShareGPT sampling stand-in)."""

    def __call__(self, text):
        return argparse.Namespace(input_ids=text.split())


@pytest.mark.parametrize("flags, sent_ignore_eos", [
    ([], True), (["--no-ignore-eos"], False), (["--ignore-eos"], True),
    (["--dataset", "{jsonl}"], False), (["--dataset", "{jsonl}", "--ignore-eos"], True)])
def test_random_workloads_ignore_eos_by_default(monkeypatch, tmp_path, flags, sent_ignore_eos):
    """A random workload's output length is part of its definition: vLLM's bench serve sends
    ignore_eos for its random datasets by default; kvflow let EOS cut outputs short unless
    --ignore-eos was given, so the same command measured different work on the two."""
    from kvflow.bench.client import build_payload

    bodies: list[dict] = []

    async def fake_run_load(requests, args, rate):
        bodies.extend(build_payload(r, args.endpoint, args.model, args.ignore_eos)
                      for r in requests)
        return [RequestResult(success=True, token_times=[0.1], prompt_tokens=4,
                              completion_tokens=1) for _ in requests], 1.0

    monkeypatch.setattr(serve, "run_load", fake_run_load)
    (tmp_path / "d.jsonl").write_text('{"prompt": [5, 6, 7], "output_len": 3}\n')
    flags = [f.format(jsonl=tmp_path / "d.jsonl") for f in flags]
    out = tmp_path / "r.json"
    assert main(["bench", "serve", "--model", NO_MODEL, "--random-vocab-size", "100",
                 "--num-prompts", "1", "--disable-tqdm", "--result-json", str(out),
                 *(["--input-len", "4"] if "--dataset" not in flags else []), *flags]) == 0
    assert [b.get("ignore_eos", False) for b in bodies] == [sent_ignore_eos] * 2  # probe, run
    assert json.loads(out.read_text())["ignore_eos"] is sent_ignore_eos


def test_vllm_random_length_flags(monkeypatch):
    """vLLM's --random-input-len/--random-output-len name the random workload's lengths
    (they were 'unrecognized arguments', exit 2)."""
    sent: list[BenchRequest] = []

    async def fake_run_load(requests, args, rate):
        sent.extend(requests)
        return [RequestResult(success=True, token_times=[0.1], prompt_tokens=4,
                              completion_tokens=1) for _ in requests], 1.0

    monkeypatch.setattr(serve, "run_load", fake_run_load)
    assert main(["bench", "serve", "--model", NO_MODEL, "--random-vocab-size", "100",
                 "--num-prompts", "2", "--random-input-len", "5", "--random-output-len", "7",
                 "--disable-tqdm"]) == 0
    assert [(len(r.prompt), r.output_len) for r in sent[1:]] == [(5, 7), (5, 7)]
    sent.clear()  # left out: the documented 128 prompt tokens, 64 output tokens
    assert main(["bench", "serve", "--model", NO_MODEL, "--random-vocab-size", "100",
                 "--num-prompts", "1", "--disable-tqdm"]) == 0
    assert [(len(r.prompt), r.output_len) for r in sent[1:]] == [(128, 64)]


@pytest.mark.parametrize("dataset, flags, needle", [
    ("random", ["--image-size", "64x64"],
     "--image-size applies to --dataset random-image only; --dataset random would ignore it"),
    ("synthetic-chat", ["--num-unique-images", "3"], ("--num-unique-images applies to "
                                                      "--dataset random-image only; "
                                                      "--dataset synthetic-chat would "
                                                      "ignore it")),
    ("random", ["--user-len", "uniform:1:2"],
     "--user-len applies to --dataset synthetic-chat only; --dataset random would ignore it"),
])
def test_another_dataset_s_flags_are_refused(capsys, dataset, flags, needle):
    """They were accepted and ignored: --image-size 64x64 on a random run sent no image."""
    assert main(["bench", "serve", "--model", NO_MODEL, "--dataset", dataset, *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"kvflow: error: {needle}\n"


@pytest.mark.parametrize("dataset, flag, needle", [
    ("synthetic-chat", "--output-len", ("--output-len is not read by --dataset "
                                         "synthetic-chat (it would be ignored): use "
                                         "--output-len-dist")),
    ("synthetic-chat", "--input-len", ("--input-len sets the prompt length of --dataset "
                                        "random and random-image only; --dataset "
                                        "synthetic-chat brings its own prompts")),
    ("share.json", "--output-len", "(it would be ignored): use --sharegpt-output-len"),
    ("lines.jsonl", "--input-len", "--input-len sets the prompt length"),
])
def test_length_flags_a_dataset_would_ignore_are_refused(tmp_path, capsys, dataset, flag,
                                                         needle):
    """README's `kvflow bench serve ... --dataset synthetic-chat` after a random run's
    `--input-len 128 --output-len 64` ran synthetic-chat's own lengths (32-128 output
    tokens) without a word."""
    if "." in dataset:
        (tmp_path / dataset).write_text('[{"conversations": []}]\n' if dataset.endswith("json")
                                        else '{"prompt": "hello there"}\n')
        dataset = str(tmp_path / dataset)
    assert main(["bench", "serve", "--model", NO_MODEL, "--dataset", dataset, flag,
                 "64"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_vllm_result_file_name():
    from datetime import datetime

    from kvflow.bench.result_file import vllm_result_filename, vllm_result_path

    # vLLM's name: {label}-{rate}qps[-concurrency{N}]-{model basename}-{%Y%m%d-%H%M%S}.json
    assert vllm_result_filename(None, float("inf"), None, "org/SmolLM2-135M",
                                "20261203-133000") == "openai-infqps-SmolLM2-135M-20261203-133000.json"
    assert vllm_result_filename("kv", 4, 8, "m", "20261203-133000") == \
        "kv-4.0qps-concurrency8-m-20261203-133000.json"
    args = argparse.Namespace(save_result=True, result_dir="out", result_filename=None,
                              request_rate=None, label=None, max_concurrency=None, model="a/b",
                              endpoint="completions")
    now = datetime(2026, 12, 3, 13, 30, 5)
    assert vllm_result_path(args, now) == "out/openai-infqps-b-20261203-133005.json"
    # vLLM's default label is its --backend: openai-chat for the chat endpoint (was: openai)
    args.endpoint = "chat"
    assert vllm_result_path(args, now) == "out/openai-chat-infqps-b-20261203-133005.json"
    args.endpoint = "completions"
    args.result_filename = "x.json"
    assert vllm_result_path(args, now) == "out/x.json"
    args.result_dir = None
    assert vllm_result_path(args, now) == "x.json"
    args.save_result = False
    assert vllm_result_path(args, now) is None


@pytest.mark.parametrize("flags, why", [
    (["--result-dir", "d"], "--result-dir names the file of --save-result"),
    (["--result-filename", "f.json"], "--result-filename names the file of --save-result"),
    (["--save-result", "--result-json", "r.json"], "not both"),
    (["--save-result", "--sweep-rates", "1,2"], "with --sweep-rates use --result-json"),
])
def test_vllm_result_flags_refused_when_they_would_not_write(capsys, tmp_path, monkeypatch,
                                                             flags, why):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "serve", "--model", NO_MODEL, *flags]) == 2
    assert why in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_save_result_writes_vllm_named_file(monkeypatch, tmp_path):
    async def fake_run_load(requests, args, rate):
        return [RequestResult(success=True, start=0.0, token_times=[0.1, 0.3], prompt_tokens=8,
                              completion_tokens=2) for _ in requests], 1.0

    monkeypatch.setattr(serve, "run_load", fake_run_load)
    argv = ["bench", "serve", "--model", "org/" + NO_MODEL.rsplit("/", 1)[-1],
            "--random-vocab-size", "1000", "--num-prompts", "2", "--input-len", "8",
            "--request-rate", "4", "--max-concurrency", "2", "--save-result", "--result-dir",
            str(tmp_path / "res"), "--label", "kv", "--disable-tqdm"]
    assert main(argv) == 0
    (written,) = (tmp_path / "res").iterdir()
    assert written.name.startswith("kv-4.0qps-concurrency2-model-") and written.suffix == ".json"
    r = json.loads(written.read_text())
    assert r["completed"] == 2 and r["mean_e2el_ms"] == pytest.approx(300.0)
    assert r["model_id"] == r["tokenizer_id"] == "org/model"  # vLLM's key names
    assert main([*argv, "--result-filename", "mine.json"]) == 0
    assert json.loads((tmp_path / "res" / "mine.json").read_text())["completed"] == 2


@pytest.mark.parametrize("dataset", ["random", "synthetic-chat", "requests.jsonl"])
def test_sharegpt_output_len_without_a_sharegpt_file_is_refused(tmp_path, capsys, dataset):
    """--sharegpt-output-len sets max_tokens of a ShareGPT file's requests only; with any
    other dataset the run went on with --output-len (or the JSONL lines' own) in silence."""
    if dataset.endswith(".jsonl"):
        (tmp_path / dataset).write_text('{"prompt": "hello there"}\n')
        dataset = str(tmp_path / dataset)
    assert main(["bench", "serve", "--model", NO_MODEL, "--dataset", dataset,
                 "--sharegpt-output-len", "100"]) == 2
    assert capsys.readouterr().err == (
        f"kvflow: error: --sharegpt-output-len applies to a ShareGPT JSON file only; "
        f"--dataset {dataset} is not one, so it would be ignored\n")


@pytest.mark.parametrize("sizes, max_num_seqs, largest", [("1,8,32", "8", 32),
                                                          ("300", None, 300)])
def test_latency_batch_above_max_num_seqs_is_refused(capsys, sizes, max_num_seqs, largest):
    """A batch of B prompts runs at most --max-num-seqs (256 by default) at once: the row
    printed for B timed smaller batches one after another, labelled B."""
    limit = ["--max-num-seqs", max_num_seqs] if max_num_seqs else []
    assert main(["bench", "latency", "--model", NO_MODEL, "--batch-sizes", sizes, *limit]) == 2
    expected = max_num_seqs or "256"
    assert capsys.readouterr().err == (
        f"kvflow: error: --batch-sizes {largest} exceeds --max-num-seqs {expected}: the engine "
        f"runs at most {expected} requests at once, so it would not time a batch of "
        f"{largest}; raise --max-num-seqs or lower the batch size\n")


def test_max_concurrency_clock_starts_after_the_wait(monkeypatch):
    """vLLM's --max-concurrency: requests arrive on schedule, wait for a slot, and each one's
    clock (its start, from which TTFT and E2E count) starts when it is sent, after the wait;
    the duration runs from the first arrival to the last response."""
    import time

    async def fake_send(session, url, payload, endpoint, headers=None):
        start = time.perf_counter()
        await asyncio.sleep(0.2)  # every request takes 200 ms
        return RequestResult(success=True, start=start, token_times=[start + 0.2],
                             end=start + 0.2)

    monkeypatch.setattr(serve, "send_request", fake_send)
    args = argparse.Namespace(base_url="http://127.0.0.1:1", endpoint="completions",
                              api_key=None, extra_body=None, burstiness=1.0, seed=0,
                              max_concurrency=1, request_timeout=10.0, disable_tqdm=True,
                              model="m", ignore_eos=False)
    reqs = [BenchRequest([5, 6], 2, 4)] * 3
    results, duration = asyncio.run(serve.run_load(reqs, args, float("inf")))
    starts = sorted(r.start - results[0].start for r in results)
    # all three arrive at once; one slot: sent at 0, >= 0.2 and >= 0.4 s (later on a busy
    # machine), each E2E still 200 ms; without the cap all three would start at 0
    assert starts[0] == 0.0 and starts[1] >= 0.19 and starts[2] - starts[1] >= 0.19
    assert all(r.token_times[-1] - r.start == pytest.approx(0.2) for r in results)
    assert duration >= 0.59


def _record_loads(monkeypatch) -> list[list[BenchRequest]]:
    """Replace ``serve.run_load`` by a fake that records each load's requests (one list per
    call: the probe's, then each rate's) and answers each with two tokens, 0.1 s apart."""
    sent: list[list[BenchRequest]] = []

    async def fake_run_load(requests, args, rate):
        sent.append(list(requests))
        return [RequestResult(success=True, token_times=[0.1, 0.2], prompt_tokens=8,
                              completion_tokens=2) for _ in requests], 1.0

    monkeypatch.setattr(serve, "run_load", fake_run_load)
    return sent
