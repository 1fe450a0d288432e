"""``kvflow serve`` start-up: seconds to ``/health`` 200, then to the first generate.

Starts ``python -m kvflow serve MODEL --port PORT`` (with ``PYTHONPATH`` at each ``--trees``
entry and the tree as its working directory, so two trees can be compared on one machine:
``tree_process``), polls ``/health`` every 50 ms, sends one
``/v1/completions`` (8 greedy tokens of "The capital of France is"), then stops the server by
its PID (SIGTERM; SIGKILL to its process group after 15 s). Rounds alternate the trees and
flip their order every round, as a shared machine drifts. Prints one JSON line per run (the
load average at its start included) and the medians per tree and model.

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


def _first_generate(port: int) -> tuple[float, str]:
    """Seconds of one 8-token greedy ``/v1/completions``, and its text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8,
                       "temperature": 0}).encode()
    start = time.monotonic()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        text = json.load(r)["choices"][0]["text"]
    return time.monotonic() - start, text


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


def time_serve(tree: str, model: str, port: int, limit_s: float = 300.0) -> dict:
    """One start of ``kvflow serve`` from ``tree``: ``health_s`` (seconds from the process
    start to ``/health`` 200), ``first_gen_s`` (seconds of the first completion) and its text.

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
        gen, text = _first_generate(port)
    finally:
        _stop(proc)
    return {"health_s": round(health, 2), "first_gen_s": round(gen, 3), "text": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", required=True, help="kvflow source trees")
    parser.add_argument("--models", nargs="+", default=["out/smollm2-hf"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18480)
    args = parser.parse_args()
    trees = [os.path.abspath(t) for t in args.trees]
    models = [os.path.abspath(m) if os.path.exists(m) else m for m in args.models]
    seen: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for model in models:
            for tree in order:
                load = os.getloadavg()[0]
                run = time_serve(tree, model, args.port)
                seen.setdefault((tree, model), []).append(run["health_s"])
                print(json.dumps({"round": r + 1, "tree": tree, "model": model,
                                  "load": round(load, 2), **run}), flush=True)
    for (tree, model), values in seen.items():
        print(f"median /health s {statistics.median(values):.2f} {tree} {model} {values}")


if __name__ == "__main__":
    main()
