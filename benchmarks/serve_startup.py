"""``kvflow serve`` start-up: seconds to ``/health`` 200, then the first requests' latency.

Starts ``python -m kvflow serve MODEL --port PORT`` (with ``PYTHONPATH`` at each ``--trees``
entry and the tree as its working directory, so two trees can be compared on one machine:
``tree_process``), polls ``/health`` every 50 ms, then sends ``--requests`` streamed
``/v1/completions`` one after another (8 greedy tokens of "The capital of France is"; the
first right after ``/health``), timing each one's first token (TTFT) and its end, then stops
the server by its PID (SIGTERM; SIGKILL to its process group after 15 s). Rounds alternate
the trees and flip their order every round, as a shared machine drifts. Prints one JSON line
per run (the load average at its start included) and the medians per tree and model:
``/health``, the first request's latency and TTFT, and the later requests' latency.

    python benchmarks/serve_startup.py --trees /tmp/before /tmp/after \\
        --models out/smollm2-hf SmolLM2-135M-Instruct --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from serve_harness import is_healthy

PROMPT = "The capital of France is"


def _served_model(port: int) -> str:
    """The id of the model the server on ``port`` serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
        return json.load(r)["data"][0]["id"]


def _timed_completion(port: int, model: str) -> tuple[float, float, str]:
    """One streamed 8-token greedy ``/v1/completions``: seconds to its first text chunk
    (TTFT), seconds to its end (``[DONE]``), and its text."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                       "stream": True}).encode()
    start = time.monotonic()
    ttft, text = None, ""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            data = line.decode().strip().removeprefix("data: ")
            if not data or data == "[DONE]":
                continue
            piece = json.loads(data)["choices"][0]["text"]
            if piece and ttft is None:
                ttft = time.monotonic() - start
            text += piece
    total = time.monotonic() - start
    return (total if ttft is None else ttft), total, text


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tree_process(tree: str) -> dict:
    """``subprocess.Popen`` keyword arguments under which ``python -m kvflow`` imports
    ``tree``'s kvflow: ``PYTHONPATH`` at it, and ``tree`` as the working directory, since
    ``-m`` (and ``-c``) put the working directory on ``sys.path`` ahead of ``PYTHONPATH``.
    (Was: ``PYTHONPATH`` only, so the script run from a clone's root started that clone's
    kvflow for every tree, and a before/after comparison timed one tree twice.)"""
    return {"env": dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1"), "cwd": tree}


def time_serve(tree: str, model: str, port: int, limit_s: float = 300.0,
               requests: int = 5) -> dict:
    """One start of ``kvflow serve`` from ``tree``: ``health_s`` (seconds from the process
    start to ``/health`` 200), then ``requests`` completions one after another
    (``_timed_completion``): ``first_gen_s`` and ``first_ttft_s`` of the first (sent at the
    ``/health`` 200), ``next_gen_s`` (the others' seconds, in order) and the first's text.

    Raises:
        RuntimeError: if the server exits or is not healthy within ``limit_s`` seconds.
    """
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvflow", "serve", model, "--port", str(port),
                             "--uvicorn-log-level", "warning"], **tree_process(tree),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while not is_healthy(f"http://127.0.0.1:{port}"):
            if proc.poll() is not None or time.monotonic() - start > limit_s:
                raise RuntimeError(f"kvflow serve {model} from {tree} did not become healthy")
            time.sleep(0.05)
        health = time.monotonic() - start
        served = _served_model(port)
        runs = [_timed_completion(port, served) for _ in range(max(requests, 1))]
    finally:
        _stop(proc)
    (ttft, gen, text), later = runs[0], runs[1:]
    return {"health_s": round(health, 2), "first_gen_s": round(gen, 3),
            "first_ttft_s": round(ttft, 3), "next_gen_s": [round(r[1], 3) for r in later],
            "text": text}


def summary(runs: list[dict]) -> dict:
    """Medians over one tree and model's runs (``time_serve``'s dicts): ``health_s``,
    ``first_gen_s``, ``first_ttft_s``, and ``next_gen_s`` over every later request."""
    later = [s for run in runs for s in run["next_gen_s"]]
    return {key: round(statistics.median(run[key] for run in runs), 3)
            for key in ("health_s", "first_gen_s", "first_ttft_s")} | {
        "next_gen_s": round(statistics.median(later), 3) if later else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", required=True, help="kvflow source trees")
    parser.add_argument("--models", nargs="+", default=["out/smollm2-hf"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18480)
    parser.add_argument("--requests", type=int, default=5,
                        help="completions per start, one after another (the first at /health)")
    args = parser.parse_args()
    trees = [os.path.abspath(t) for t in args.trees]
    models = [os.path.abspath(m) if os.path.exists(m) else m for m in args.models]
    seen: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for model in models:
            for tree in order:
                load = os.getloadavg()[0]
                run = time_serve(tree, model, args.port, requests=args.requests)
                seen.setdefault((tree, model), []).append(run)
                print(json.dumps({"round": r + 1, "tree": tree, "model": model,
                                  "load": round(load, 2), **run}), flush=True)
    for (tree, model), runs in seen.items():
        print("median", json.dumps({"tree": tree, "model": model, **summary(runs)}))


if __name__ == "__main__":
    main()
