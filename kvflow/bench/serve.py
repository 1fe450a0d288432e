"""``kvflow bench serve``: load-test any OpenAI-compatible server.

Requests arrive at ``--request-rate`` (gamma-distributed gaps, ``--burstiness`` 1 = Poisson),
at most ``--max-concurrency`` in flight; each streams, so TTFT and every inter-token gap are
measured on the client (kvflow/bench/client.py). The summary (throughputs, mean/median/p90/p99
of TTFT, TPOT, ITL and end-to-end latency in ms, goodput under ``--goodput`` SLOs) is printed
and written to ``--result-json``. ``--sweep-rates`` repeats the run per rate (a generated workload
drawn afresh with ``--seed`` + i for the i-th rate) and plots latency against throughput (kvflow/bench/plot.py). Metric definitions: kvflow/bench/metrics.py.
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
from kvflow.bench.client import ENDPOINT_PATHS, RequestResult, build_payload, send_request
from kvflow.bench.datasets import BenchRequest, arrival_intervals
from kvflow.bench.result_file import VLLM_BACKENDS, vllm_result_path
from kvflow.bench.serve_checks import check_args, load_compare, parse_rates
from kvflow.bench.serve_summary import aggregate, finite, print_summary
from kvflow.bench.serve_workload import build_requests, make_tokenizer_factory
from kvflow.bench.sharegpt import is_json_array_file

# Idle seconds before the client drops a pooled connection: below the servers' keep-alive
# (uvicorn's default 5 s), so a request is never sent on a connection the server is closing
# (that race surfaces as aiohttp's ServerDisconnectedError at arrival gaps near 5 s).
CLIENT_KEEPALIVE_S = 3.0
# Workloads drawn from --seed: each rate of a sweep after the first draws its own (seed + i),
# so no run finds the previous runs' prompts in the server's prefix cache (a ShareGPT file is
# sampled from --seed too).
GENERATED_DATASETS = ("random", "synthetic-chat", "random-image")
# Workloads whose requests send ignore_eos unless --no-ignore-eos: their output lengths are
# part of the workload's definition (vLLM defaults to it for its random datasets too).
IGNORE_EOS_DATASETS = ("random", "random-image")
# Printed (stdout, flushed) right before a run's first request.
LOAD_START_LINE = "kvflow bench: starting the load"


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
    """One benchmark run at ``rate`` req/s; returns the summary with its settings. Prints
    ``LOAD_START_LINE`` (flushed) just before the first request is sent, so that a wrapper
    measuring the load (benchmarks/served_cpu_split.py) can tell the load from the start-up."""
    print(f"{LOAD_START_LINE}: {len(requests)} requests at {rate} req/s", flush=True)
    results, duration = asyncio.run(run_load(requests, args, rate))
    summary = aggregate(requests, results, duration, slos, tokenizer_factory)
    settings = {"label": args.label or args.base_url, "date": datetime.now(timezone.utc)
                .strftime("%Y-%m-%dT%H:%M:%SZ"), "base_url": args.base_url,
                "model": args.model, "endpoint": args.endpoint, "dataset": args.dataset,
                # vLLM's names of the model and tokenizer in its result files, and its
                # backend of the endpoint (the client that sends the same requests)
                "model_id": args.model, "tokenizer_id": args.tokenizer or args.model,
                "backend": VLLM_BACKENDS[args.endpoint],
                "endpoint_type": VLLM_BACKENDS[args.endpoint],
                "num_prompts": len(requests),
                "request_rate": "inf" if math.isinf(rate) else rate,
                "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                "ignore_eos": args.ignore_eos, "seed": args.seed,
                "num_images": sum(r.num_images for r in requests)}
    if args.dataset == "random":
        settings.update(random_range_ratio=args.random_range_ratio,
                        random_prefix_len=args.random_prefix_len)
    if args.dataset == "random-image":
        settings.update(image_size=args.image_size, image_fraction=args.image_fraction,
                        num_unique_images=args.num_unique_images)
    return {**settings, **summary}


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")
    check_args(args)
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset in IGNORE_EOS_DATASETS
    slos = metrics.parse_goodput(args.goodput or [])
    tokenizer_factory = make_tokenizer_factory(args.tokenizer or args.model,
                                               "--tokenizer" if args.tokenizer else None)
    if args.tokenizer:
        tokenizer_factory()  # a --tokenizer that does not load fails here, before any request
    requests = build_requests(args, tokenizer_factory)
    if not requests:
        raise ValueError("the dataset has no requests")
    try:
        asyncio.run(probe(requests, args))
    except RuntimeError as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 1
    rates = parse_rates(args.sweep_rates) if args.sweep_rates else \
        [math.inf if args.request_rate is None else args.request_rate]
    redraw = args.dataset in GENERATED_DATASETS or is_json_array_file(args.dataset)
    if len(rates) > 1 and not redraw:
        print(f"kvflow: note: every rate of --sweep-rates sends the prompts of {args.dataset} "
              "again; a server with prefix caching serves the later runs partly from its "
              "cache", file=sys.stderr)
    runs = []
    for i, rate in enumerate(rates):
        run_args, run_requests = args, requests
        if i and redraw:
            run_args = argparse.Namespace(**{**vars(args), "seed": args.seed + i})
            run_requests = build_requests(run_args, tokenizer_factory)
        runs.append(run_one(run_requests, run_args, rate, slos, tokenizer_factory))
        print_summary(runs[-1])
    _write_outputs(args, runs)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _write_outputs(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    result_path = args.result_json or vllm_result_path(args, datetime.now())
    if result_path:
        doc = runs[0] if not args.sweep_rates else {"label": runs[0]["label"], "sweep": runs}
        with open(result_path, "w") as f:
            json.dump(finite(doc), f, indent=1, allow_nan=False)
        print(f"results written to {result_path}")
    if args.sweep_rates or args.compare:
        from kvflow.bench.plot import plot_sweeps

        path = args.plot or os.path.splitext(result_path or "sweep")[0] + ".png"
        others = [load_compare(p) for p in args.compare or []]
        plot_sweeps([(runs[0]["label"], runs), *others], path)
        print(f"plot written to {path}")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``kvflow bench serve``'s parser to ``sub`` (the ``kvflow bench`` subcommands): the
    server and model, then the workload, load and output flag groups, in that order (the order
    of ``--help``)."""
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(p)
    _add_workload_args(p.add_argument_group("workload"))
    _add_load_args(p.add_argument_group("load"))
    _add_output_args(p.add_argument_group("output"))
    p.set_defaults(func=_cmd_serve)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    """The server under test and what each request names: URL, model, endpoint, key, label."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for counts when the server sends no usage (default: --model, "
                   "if a tokenizer loads from it; a --tokenizer that does not load is an error)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions",
                   help="the OpenAI route the requests go to")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--label", default=None, help="name of this server in results and plots")


def _add_workload_args(d: argparse._ArgumentGroup) -> None:
    """The ``workload`` group: which prompts are sent and how each request is built."""
    _add_synthetic_dataset_args(d)
    _add_file_and_chat_dataset_args(d)
    _add_request_body_args(d)


def _add_synthetic_dataset_args(d: argparse._ArgumentGroup) -> None:
    """The dataset, the number of prompts, and the random and random-image datasets' sizes."""
    d.add_argument("--dataset", default="random",
                   help="random | synthetic-chat | random-image | FILE.jsonl | a ShareGPT "
                   "FILE.json (sampled as vLLM's --dataset-name sharegpt)")
    d.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    d.add_argument("--input-len", "--random-input-len", type=int, default=None,
                   help="random: prompt tokens; random-image: words of text (default: 128; "
                   "refused with other datasets, which would ignore it; vLLM's name "
                   "--random-input-len also works)")
    d.add_argument("--image-size", default=None,
                   help="random-image: WIDTHxHEIGHT (default: 448x448)")
    d.add_argument("--image-fraction", type=float, default=None,
                   help="random-image: share of requests with an image (0-1)")
    d.add_argument("--num-unique-images", type=int, default=None,
                   help="random-image: distinct images drawn round-robin (0: all distinct)")
    d.add_argument("--output-len", "--random-output-len", type=int, default=None,
                   help="max_tokens (random, random-image, jsonl lines without their own; "
                   "default: 64; refused with synthetic-chat and ShareGPT files, which would "
                   "ignore it; vLLM's name --random-output-len also works)")
    d.add_argument("--random-range-ratio", type=float, default=None,
                   help="random: draw each prompt length from [floor(L*(1-R)), ceil(L*(1+R))] "
                   "for --input-len L, and each output length likewise (vLLM's; 0 <= R < 1; "
                   "default 0: fixed lengths)")
    d.add_argument("--random-prefix-len", type=int, default=None,
                   help="random: this many random ids, the same for every request, before "
                   "each prompt (vLLM's; default 0)")
    d.add_argument("--random-vocab-size", type=int, default=None,
                   help="random: ids drawn from [3, min(this, 32000)) (default: tokenizer size)")


def _add_file_and_chat_dataset_args(d: argparse._ArgumentGroup) -> None:
    """JSONL / ShareGPT files' order and output length; synthetic-chat's length distributions."""
    d.add_argument("--disable-shuffle", action="store_true",
                   help="JSONL / ShareGPT file: take the first --num-prompts in file order "
                   "(default: shuffled with --seed first, as vLLM)")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="ShareGPT: max_tokens of every request (default: each conversation's "
                   "reply length)")
    d.add_argument("--num-system-prompts", type=int, default=None,
                   help="synthetic-chat (default: 4)")
    d.add_argument("--system-len", default=None,
                   help="synthetic-chat, words (default: uniform:200:400)")
    d.add_argument("--user-len", default=None, help="synthetic-chat, words (default: "
                   "uniform:16:256)")
    d.add_argument("--output-len-dist", default=None,
                   help="synthetic-chat, tokens (default: uniform:32:128)")


def _add_request_body_args(d: argparse._ArgumentGroup) -> None:
    """What every request body carries beside its prompt (ignore_eos, extra JSON), and the
    seed of the workload's draws."""
    d.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos (vLLM extension) so every output is max_tokens long "
                   "(default: on for random and random-image, as vLLM's random datasets; off "
                   "otherwise)")
    d.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    d.add_argument("--seed", type=int, default=0,
                   help="seeds the dataset draw (and shuffle) and the arrival gaps")


def _add_load_args(t: argparse._ArgumentGroup) -> None:
    """The ``load`` group: arrival rate and burstiness, concurrency, timeouts, goodput SLOs."""
    t.add_argument("--request-rate", type=float, default=None,
                   help="req/s, or inf (the default); not with --sweep-rates")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps (1 = Poisson)")
    t.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    t.add_argument("--request-timeout", type=float, default=6 * 3600.0,
                   help="seconds per request")
    t.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2e:5000 (e2el: vLLM's name for e2e)")


def _add_output_args(o: argparse._ArgumentGroup) -> None:
    """The ``output`` group: result files, rate sweeps and their plots, the progress bar."""
    o.add_argument("--result-json", default=None, help="write the summary here")
    o.add_argument("--save-result", action="store_true",
                   help="vLLM's way: write the summary to --result-filename, or by default "
                   "to LABEL-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json (LABEL: "
                   "--label, else openai, or openai-chat with --endpoint chat, vLLM's backends), in "
                   "--result-dir (default: here)")
    o.add_argument("--result-dir", default=None, help="folder of --save-result's file")
    o.add_argument("--result-filename", default=None, help="name of --save-result's file")
    o.add_argument("--sweep-rates", default=None, help="e.g. 1,2,4,8,inf: one run per rate")
    o.add_argument("--plot", default=None, help="sweep PNG (default: next to --result-json)")
    o.add_argument("--compare", action="append", metavar="RESULT.json",
                   help="other servers' sweep results to plot alongside (repeat)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
