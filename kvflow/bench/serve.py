"""``kvflow bench serve``: load-test any OpenAI-compatible server.

Requests arrive at ``--request-rate`` (gamma-distributed gaps, ``--burstiness`` 1 = Poisson),
at most ``--max-concurrency`` in flight; each streams, so TTFT and every inter-token gap are
measured on the client (kvflow/bench/client.py). The summary (throughputs, mean/median/p90/p99
of TTFT, TPOT, ITL and end-to-end latency in ms, goodput under ``--goodput`` SLOs) is printed
and written to ``--result-json``. ``--sweep-rates`` repeats the run per rate and plots latency
against throughput (kvflow/bench/plot.py). Metric definitions: kvflow/bench/metrics.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

import aiohttp

from kvflow.bench import metrics
from kvflow.bench.checks import ensure_parent_dir, is_finite_positive, require_positive
from kvflow.bench.client import ENDPOINT_PATHS, RequestResult, build_payload, send_request
from kvflow.bench.datasets import (
    BenchRequest,
    arrival_intervals,
    load_jsonl,
    parse_image_size,
    parse_length_dist,
    random_image_requests,
    random_requests,
    synthetic_chat_requests,
)

MAX_ERRORS_KEPT = 20
# Idle seconds before the client drops a pooled connection: below the servers' keep-alive
# (uvicorn's default 5 s), so a request is never sent on a connection the server is closing
# (that race surfaces as aiohttp's ServerDisconnectedError at arrival gaps near 5 s).
CLIENT_KEEPALIVE_S = 3.0


def build_requests(args: argparse.Namespace, tokenizer_factory) -> list[BenchRequest]:
    """The workload of ``args.dataset``. Random prompts are token ids for the completions
    endpoint and the tokenizer's decoding of them for chat.

    Raises:
        ValueError: for random prompts on the chat endpoint without a tokenizer, a JSONL
            dataset with chat messages on the completions endpoint, a dataset file that cannot
            be read or has a bad line, or a bad length distribution.
    """
    if args.dataset == "random":
        vocab = args.random_vocab_size
        if vocab is None:
            tok = tokenizer_factory()
            vocab = len(tok) if tok is not None else 32000
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len,
                               vocab_size=vocab, seed=args.seed)
        if args.endpoint == "chat":
            tok = tokenizer_factory()
            if tok is None:
                raise ValueError("--dataset random with --endpoint chat needs a tokenizer "
                                 "(--tokenizer)")
            reqs = [BenchRequest(tok.decode(r.prompt), r.prompt_len, r.output_len)
                    for r in reqs]
        return reqs
    if args.dataset == "random-image":
        if args.endpoint != "chat":
            raise ValueError("--dataset random-image sends images in chat messages: use "
                             "--endpoint chat")
        return random_image_requests(
            args.num_prompts, args.input_len, args.output_len,
            parse_image_size(args.image_size), args.image_fraction, args.num_unique_images,
            seed=args.seed)
    if args.dataset == "synthetic-chat":
        return synthetic_chat_requests(
            args.num_prompts, args.num_system_prompts, parse_length_dist(args.system_len),
            parse_length_dist(args.user_len), parse_length_dist(args.output_len_dist),
            seed=args.seed)
    reqs = load_jsonl(args.dataset, args.output_len)
    if args.num_prompts < len(reqs):
        reqs = reqs[:args.num_prompts]
    if args.endpoint == "completions" and any(r.messages for r in reqs):
        raise ValueError(f"{args.dataset} has chat messages: use --endpoint chat")
    return reqs


def make_tokenizer_factory(name: str | None):
    """A memoizing zero-argument callable returning the tokenizer of ``name`` (a packaged model,
    HF folder, GGUF file or hub id), or None when it cannot be loaded."""
    cache: dict[str, Any] = {}

    def get() -> Any:
        if "tok" not in cache:
            cache["tok"] = _load_tokenizer(name) if name else None
        return cache["tok"]

    return get


def _load_tokenizer(name: str) -> Any:
    from kvflow.models.loader import load_tokenizer
    from kvflow.models.model_resolver import resolve_model

    try:
        return load_tokenizer(resolve_model(name))
    except Exception:  # noqa: BLE001 - not a local model: try the hub cache
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name)
        except Exception:  # noqa: BLE001
            return None


async def run_load(requests: list[BenchRequest], args: argparse.Namespace,
                   rate: float) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns results (in request order) and the
    wall time from the first send to the last response, in seconds."""
    url = args.base_url.rstrip("/").removesuffix("/v1") + ENDPOINT_PATHS[args.endpoint]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    extra = json.loads(args.extra_body) if args.extra_body else None
    gaps = arrival_intervals(len(requests), rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    progress = _progress(len(requests), args.disable_tqdm)

    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(
                                         limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)) as session:
        async def one(req: BenchRequest) -> RequestResult:
            payload = build_payload(req, args.endpoint, args.model, args.ignore_eos, extra)
            if limit is None:
                result = await send_request(session, url, payload, args.endpoint, headers)
            else:
                async with limit:
                    result = await send_request(session, url, payload, args.endpoint, headers)
            progress.update(1)
            return result

        start, due, tasks = time.perf_counter(), 0.0, []
        for req, gap in zip(requests, gaps):
            due += float(gap)
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


def _progress(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=disable, desc="requests", unit="req")


def _token_counts(req: BenchRequest, res: RequestResult, tokenizer_factory) -> tuple[int, int]:
    """(prompt tokens, output tokens): the server's usage, else the tokenizer, else the
    dataset's prompt length and the number of token chunks."""
    prompt, output = res.prompt_tokens, res.completion_tokens
    if output is None or prompt is None:
        tok = tokenizer_factory()
        if output is None:
            output = (len(tok.encode(res.text, add_special_tokens=False)) if tok is not None
                      else len(res.token_times))
        if prompt is None:
            prompt = req.prompt_len
            if tok is not None and isinstance(req.prompt, str):
                prompt = len(tok.encode(req.prompt))
    return prompt, output


def aggregate(requests: list[BenchRequest], results: list[RequestResult], duration: float,
              slos: dict[str, float], tokenizer_factory) -> dict[str, Any]:
    """The benchmark summary (flat keys as in vLLM's serving benchmark; latencies in ms,
    throughputs per second) plus per-request lists."""
    timings, in_lens, out_lens, usage_ok, errors = [], [], [], 0, []
    for req, res in zip(requests, results):
        if not res.success:
            errors.append(res.error)
            continue
        prompt_len, out_len = _token_counts(req, res, tokenizer_factory)
        usage_ok += res.completion_tokens is not None
        in_lens.append(prompt_len)
        out_lens.append(out_len)
        timings.append(metrics.request_timing(res.start, res.token_times, res.end, out_len))
    out = {"duration": duration, "completed": len(timings), "failed": len(errors),
           "failed_by_kind": error_kinds(errors), "usage_from_server": usage_ok, "total_input_tokens": sum(in_lens),
           "total_output_tokens": sum(out_lens),
           "request_throughput": len(timings) / duration,
           "output_throughput": sum(out_lens) / duration,
           "total_token_throughput": (sum(in_lens) + sum(out_lens)) / duration}
    series = {"ttft": [t.ttft for t in timings], "e2e": [t.e2e for t in timings],
              "tpot": [t.tpot for t in timings if t.tpot is not None],
              "itl": [gap for t in timings for gap in t.itls]}
    for name, values in series.items():
        for stat, value in metrics.summarize(values, scale=1e3).items():
            out[f"{stat}_{name}_ms"] = value
    if slos:
        out["goodput_slos_ms"] = {k: v * 1e3 for k, v in slos.items()}
        out["good_requests"], out["request_goodput"] = metrics.goodput(timings, slos, duration)
    out.update(input_lens=in_lens, output_lens=out_lens, ttfts=series["ttft"],
               itls=[list(t.itls) for t in timings], errors=errors[:MAX_ERRORS_KEPT])
    return out


def error_kinds(errors: list[str]) -> dict[str, int]:
    """Failures counted by kind: the text before the first colon of each error
    (``HTTP 503``, ``TimeoutError``, ``error event in stream``, ...)."""
    kinds: dict[str, int] = {}
    for error in errors:
        kind = error.split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def print_summary(r: dict[str, Any]) -> None:
    """The human-readable table of one run."""
    rows = [("Request rate (req/s)", r["request_rate"]),
            ("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
            ("Benchmark duration (s)", r["duration"]),
            ("Total input tokens", r["total_input_tokens"]),
            ("Total generated tokens", r["total_output_tokens"]),
            ("Request throughput (req/s)", r["request_throughput"]),
            ("Output token throughput (tok/s)", r["output_throughput"]),
            ("Total token throughput (tok/s)", r["total_token_throughput"])]
    if "request_goodput" in r:
        rows.append(("Request goodput (req/s)", r["request_goodput"]))
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        rows += [(f"{stat.capitalize()} {title} (ms)", r[f"{stat}_{name}_ms"])
                 for stat in ("mean", "median", "p90", "p99")]
    print(f"{' ' + r['label'] + ' ':=^52}")
    for name, value in rows:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{name:<40}{shown:>12}")
    _print_errors(r)


def _print_errors(r: dict[str, Any]) -> None:
    if not r["failed"]:
        return
    print(f"{r['failed']} request(s) failed; distinct errors:")
    for err in dict.fromkeys(r["errors"]):
        print(f"  {err}")


async def probe(requests: list[BenchRequest], args: argparse.Namespace) -> None:
    """Send the first request with max_tokens=2 and stop the benchmark on failure (a wrong
    URL or model name would otherwise fail every request); the probe's prompt (or every chat
    message's content) is the first one reversed, so it leaves no prefix-cache entry for the
    measured run. Raises RuntimeError."""
    first = requests[0]
    messages = None if first.messages is None else [
        {**m, "content": _reversed_text(m["content"])} for m in first.messages]
    short = BenchRequest(first.prompt[::-1], first.prompt_len, 2, messages)
    probe_args = argparse.Namespace(**{**vars(args), "max_concurrency": None,
                                       "disable_tqdm": True})
    results, _ = await run_load([short], probe_args, math.inf)
    if not results[0].success:
        raise RuntimeError(f"probe request failed: {results[0].error}")


def _reversed_text(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message content with its text reversed and its images left out (the probe must
    not warm the prefix or encoder cache for the measured run)."""
    if isinstance(content, str):
        return content[::-1]
    return [{**p, "text": p["text"][::-1]} for p in content if isinstance(p.get("text"), str)]


def run_one(requests: list[BenchRequest], args: argparse.Namespace, rate: float,
            slos: dict[str, float], tokenizer_factory) -> dict[str, Any]:
    """One benchmark run at ``rate`` req/s; returns the summary with its settings."""
    results, duration = asyncio.run(run_load(requests, args, rate))
    summary = aggregate(requests, results, duration, slos, tokenizer_factory)
    settings = {"label": args.label or args.base_url, "date": datetime.now(timezone.utc)
                .strftime("%Y-%m-%dT%H:%M:%SZ"), "base_url": args.base_url,
                "model": args.model, "endpoint": args.endpoint, "dataset": args.dataset,
                "num_prompts": len(requests),
                "request_rate": "inf" if math.isinf(rate) else rate,
                "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                "ignore_eos": args.ignore_eos, "seed": args.seed,
                "num_images": sum(r.num_images for r in requests)}
    if args.dataset == "random-image":
        settings.update(image_size=args.image_size, image_fraction=args.image_fraction,
                        num_unique_images=args.num_unique_images)
    return {**settings, **summary}


def parse_rates(spec: str) -> list[float]:
    """``"1,2,inf"`` -> [1.0, 2.0, inf]. Raises ValueError for anything but positive numbers
    or inf."""
    try:
        rates = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):  # NaN fails r > 0
        raise ValueError(f"bad --sweep-rates {spec!r}: give positive numbers or inf, "
                         f"comma-separated")
    return rates


def check_args(args: argparse.Namespace) -> None:
    """Reject bad flags before anything is loaded or sent. Raises ValueError naming the flag."""
    require_positive(num_prompts=args.num_prompts, output_len=args.output_len,
                     input_len=args.input_len if args.dataset in ("random", "random-image")
                     else None,
                     max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                     request_timeout=args.request_timeout)
    if args.dataset == "random-image":
        _check_image_args(args)
    if not is_finite_positive(args.burstiness):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    if args.extra_body is not None:
        try:
            extra = json.loads(args.extra_body)
        except ValueError as e:
            raise ValueError(f"--extra-body is not valid JSON: {e}") from e
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object, e.g. '{\"top_k\": 5}'")
    if args.sweep_rates:
        parse_rates(args.sweep_rates)
    for path in args.compare or []:
        _load_compare(path)
    ensure_parent_dir(args.result_json, "--result-json")
    ensure_parent_dir(args.plot, "--plot")


def _check_image_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag for a bad random-image workload."""
    parse_image_size(args.image_size)
    if not 0.0 <= args.image_fraction <= 1.0:
        raise ValueError(f"--image-fraction must be in [0, 1], got {args.image_fraction}")
    if args.num_unique_images < 0:
        raise ValueError(f"--num-unique-images must be >= 0, got {args.num_unique_images}")
    if args.endpoint != "chat":
        raise ValueError("--dataset random-image sends images in chat messages: use "
                         "--endpoint chat")


def _load_compare(path: str) -> tuple[str, list[dict[str, Any]]]:
    from kvflow.bench.plot import load_sweep

    try:
        return load_sweep(path)
    except OSError as e:
        raise ValueError(f"--compare {path}: cannot read it ({e.strerror})") from e
    except ValueError as e:
        raise ValueError(f"--compare {path}: not a kvflow bench serve result ({e})") from e


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")
    check_args(args)
    slos = metrics.parse_goodput(args.goodput or [])
    tokenizer_factory = make_tokenizer_factory(args.tokenizer or args.model)
    requests = build_requests(args, tokenizer_factory)
    if not requests:
        raise ValueError("the dataset has no requests")
    try:
        asyncio.run(probe(requests, args))
    except RuntimeError as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 1
    rates = parse_rates(args.sweep_rates) if args.sweep_rates else [args.request_rate]
    runs = []
    for rate in rates:
        runs.append(run_one(requests, args, rate, slos, tokenizer_factory))
        print_summary(runs[-1])
    _write_outputs(args, runs)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _write_outputs(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    if args.result_json:
        doc = runs[0] if not args.sweep_rates else {"label": runs[0]["label"], "sweep": runs}
        with open(args.result_json, "w") as f:
            json.dump(_finite(doc), f, indent=1, allow_nan=False)
        print(f"results written to {args.result_json}")
    if args.sweep_rates or args.compare:
        from kvflow.bench.plot import plot_sweeps

        path = args.plot or os.path.splitext(args.result_json or "sweep")[0] + ".png"
        others = [_load_compare(p) for p in args.compare or []]
        plot_sweeps([(runs[0]["label"], runs), *others], path)
        print(f"plot written to {path}")


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON has no NaN: a statistic
    of no values, e.g. the TPOT of one-token outputs, is written as null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for counts when the server sends no usage (default: --model)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--label", default=None, help="name of this server in results and plots")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", default="random",
                   help="random | synthetic-chat | random-image | FILE.jsonl")
    d.add_argument("--num-prompts", type=int, default=64)
    d.add_argument("--input-len", type=int, default=128,
                   help="random: prompt tokens; random-image: words of text")
    d.add_argument("--image-size", default="448x448", help="random-image: WIDTHxHEIGHT")
    d.add_argument("--image-fraction", type=float, default=0.5,
                   help="random-image: share of requests with an image (0-1)")
    d.add_argument("--num-unique-images", type=int, default=0,
                   help="random-image: distinct images drawn round-robin (0: all distinct)")
    d.add_argument("--output-len", type=int, default=64, help="max_tokens (random, jsonl)")
    d.add_argument("--random-vocab-size", type=int, default=None,
                   help="random: ids drawn from [3, min(this, 32000)) (default: tokenizer size)")
    d.add_argument("--num-system-prompts", type=int, default=4, help="synthetic-chat")
    d.add_argument("--system-len", default="uniform:200:400", help="synthetic-chat, words")
    d.add_argument("--user-len", default="uniform:16:256", help="synthetic-chat, words")
    d.add_argument("--output-len-dist", default="uniform:32:128", help="synthetic-chat, tokens")
    d.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    d.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    d.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("load")
    t.add_argument("--request-rate", type=float, default=math.inf, help="req/s, or inf")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps (1 = Poisson)")
    t.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    t.add_argument("--request-timeout", type=float, default=6 * 3600.0,
                   help="seconds per request")
    t.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2e:5000")
    o = p.add_argument_group("output")
    o.add_argument("--result-json", default=None, help="write the summary here")
    o.add_argument("--sweep-rates", default=None, help="e.g. 1,2,4,8,inf: one run per rate")
    o.add_argument("--plot", default=None, help="sweep PNG (default: next to --result-json)")
    o.add_argument("--compare", action="append", metavar="RESULT.json",
                   help="other servers' sweep results to plot alongside (repeat)")
    o.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=_cmd_serve)
