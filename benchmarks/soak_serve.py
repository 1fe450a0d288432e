"""Soak test of ``kvflow serve`` on CPU: ``kvflow bench serve`` at twice the server's capacity
for a long time (issue 22). Passes when

* every request is answered or shed with 503 (``--max-waiting-requests`` sheds the excess);
* the resident memory (RSS) of the server and its engine-core process is flat after warm-up:
  the mean of the last quarter of the samples is within ``--rss-tolerance`` of the mean of the
  first quarter after warm-up;
* the KV pool is back to idle at the end (/metrics: every usable block free, nothing running
  or waiting).

The server runs ``--max-num-seqs`` requests at a time, so its capacity is well defined; it is
measured first on the same server: ``--calib-prompts`` requests at rate inf with at most
``--max-waiting-requests`` in flight (the running batch full, nothing shed) give the
completed requests per second. Everything talks to 127.0.0.1 only.

Usage (docs/benchmarks.md): ``.venv/bin/python benchmarks/soak_serve.py --minutes 30``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from serve_harness import bench_serve, start_server, stop_server, wait_ready


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load", type=float, default=2.0, help="offered load / capacity")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--calib-prompts", type=int, default=32)
    p.add_argument("--max-waiting-requests", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--warmup-frac", type=float, default=0.2)
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--out", default="out/soak")
    p.add_argument("--server-args", default="--dtype float32",
                   help="extra kvflow serve flags (one string)")
    return p.parse_args()


def start(args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen, str]:
    """The soak's server (its own capacity: ``--max-num-seqs``, sheds past
    ``--max-waiting-requests``), healthy; exits the script if it does not come up."""
    proc, url = start_server(
        [args.model, "--max-waiting-requests", str(args.max_waiting_requests),
         "--max-num-seqs", str(args.max_num_seqs), "--uvicorn-log-level", "warning",
         *args.server_args.split()], out / "server.log", {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_ready(proc, url)
    except RuntimeError as e:
        sys.exit(f"{e}; see {out / 'server.log'}")
    return proc, url


def bench(args: argparse.Namespace, url: str, rate: str, num_prompts: int,
          result: Path, extra: tuple[str, ...] = ()) -> dict:
    try:
        return bench_serve(url, [
            "--model", args.model, "--dataset", "random", "--num-prompts", str(num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--ignore-eos", "--request-rate", rate, "--request-timeout", "600",
            "--seed", "0", *extra], result)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` and its children (KiB); 0 for a process that is gone."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(stat.parent.name) != pid and int(fields[1]) != pid:
                continue
            status = (stat.parent / "status").read_text()
        except (OSError, ValueError, IndexError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def sample_rss(pid: int, stop: threading.Event, samples: list[tuple[float, int]]) -> None:
    start = time.monotonic()
    while not stop.wait(5.0):
        samples.append((time.monotonic() - start, rss_kib(pid)))


def rss_verdict(samples: list[tuple[float, int]], warmup_frac: float,
                tolerance: float) -> dict:
    after = samples[int(len(samples) * warmup_frac):]
    quarter = max(1, len(after) // 4)
    first = sum(r for _, r in after[:quarter]) / quarter
    last = sum(r for _, r in after[-quarter:]) / quarter
    growth = (last - first) / first if first else 0.0
    return {"rss_first_quarter_mib": first / 1024, "rss_last_quarter_mib": last / 1024,
            "rss_growth": growth, "rss_flat": growth <= tolerance, "rss_samples": len(samples)}


def kv_idle(url: str, timeout: float = 60.0) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while True:
        values: dict[str, float] = {}  # summed over the data-parallel replicas ("engine")
        for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in f.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value
        state = {k: values.get(f"kvflow:{k}") for k in (
            "kv_cache_free_blocks", "kv_cache_usable_blocks", "num_requests_running",
            "num_requests_waiting")}
        state["kv_idle"] = state["kv_cache_free_blocks"] == state["kv_cache_usable_blocks"] \
            and state["num_requests_running"] == 0 and state["num_requests_waiting"] == 0
        if state["kv_idle"] or time.monotonic() > deadline:
            return state
        time.sleep(1.0)


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc, url = start(args, out)
    try:
        calib = bench(args, url, "inf", args.calib_prompts, out / "calibration.json",
                      ("--max-concurrency", str(args.max_waiting_requests)))
        capacity = calib["completed"] / calib["duration"]
        rate = args.load * capacity
        num_prompts = max(1, int(rate * args.minutes * 60))
        print(f"capacity {capacity:.3f} req/s; soak at {rate:.3f} req/s, {num_prompts} "
              f"requests over {args.minutes:g} min", flush=True)
        samples: list[tuple[float, int]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(proc.pid, stop, samples),
                                   daemon=True)
        sampler.start()
        try:
            soak = bench(args, url, f"{rate:.4f}", num_prompts, out / "soak.json")
        finally:
            stop.set()
            sampler.join()
        verdict = summarize(args, capacity, rate, num_prompts, soak, samples, url)
    finally:
        stop_server(proc, 60)
    (out / "rss.csv").write_text("seconds,rss_kib\n" + "".join(
        f"{t:.1f},{r}\n" for t, r in samples))
    (out / "verdict.json").write_text(json.dumps(verdict, indent=2))
    print(json.dumps(verdict, indent=2))
    return 0 if verdict["pass"] else 1


def summarize(args, capacity, rate, num_prompts, soak, samples, url) -> dict:
    kinds = soak.get("failed_by_kind", {})
    answered_or_shed = soak["completed"] + kinds.get("HTTP 503", 0) == num_prompts
    verdict = {"capacity_req_s": capacity, "offered_req_s": rate, "requests": num_prompts,
               "completed": soak["completed"], "failed_by_kind": kinds,
               "answered_or_shed_503": answered_or_shed, "duration_s": soak["duration"],
               **rss_verdict(samples, args.warmup_frac, args.rss_tolerance), **kv_idle(url)}
    verdict["pass"] = answered_or_shed and verdict["rss_flat"] and verdict["kv_idle"]
    return verdict


if __name__ == "__main__":
    sys.exit(main())
