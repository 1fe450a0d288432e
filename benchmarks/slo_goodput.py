"""Goodput with service-level targets vs the fixed token budget (issue 18), CPU, one script.

Two ``kvflow serve`` processes of the same model start side by side (127.0.0.1, free ports):

* ``fixed``: today's scheduler, the fixed ``max_num_batched_tokens`` budget;
* ``sla``: the same plus ``--target-tpot-ms 80 --target-ttft-ms 2000`` (times
  ``--slo-scale``) and ``--sla-args`` (default ``--admission-control``: a request predicted
  to miss its TTFT is refused at once with 503, and counts as not good).

Both servers first serve ``--warmup-prompts`` requests (untimed: the sla server's step-time
model learns and settles, and both have compiled and cached alike). Capacity is measured first
on ``fixed`` (``--calib-prompts`` requests at rate inf: completed
requests per second). Then, for each multiple of it in ``--loads``, ``kvflow bench serve``
runs the same synthetic-chat workload with the same seed (so the same prompts and the same
arrival times) against ``fixed`` and ``sla``, alternating which goes first every round and load so both
see the same machine load; the idle server's engine sleeps (it blocks on its input socket).
Goodput counts requests with TTFT <= 2 s and TPOT <= 80 ms (``--goodput``).

After each run the server's /metrics is scraped for the step-time model's error
(``kvflow:step_time_model_rel_error``, ``..._abs_error_seconds``: means over the model's recent
window) and the requests refused so far (``kvflow:requests_rejected_total``).

Writes to ``--out``: one result JSON per (server, load, round), ``fixed.json`` / ``sla.json``
(sweeps in ``kvflow bench serve --sweep-rates`` form: the median round per rate), the latency
plot ``sweep.png`` (``kvflow.bench.plot``) and ``goodput.png`` (good requests per second
against offered rate, both servers), and ``summary.json`` (with ``uptime`` and the ``lscpu``
model name and flags before and after).

Usage (docs/benchmarks.md)::

    .venv/bin/python benchmarks/slo_goodput.py --out out/slo_goodput
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from serve_harness import bench_serve, start_server, stop_server, wait_ready


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--calib-prompts", type=int, default=24)
    p.add_argument("--warmup-prompts", type=int, default=8,
                   help="requests sent to each server before anything is timed (untimed)")
    p.add_argument("--loads", default="1.5,2,3", help="offered rate / capacity")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--server-args", default="--dtype float32 --kv-cache-memory 256MiB")
    p.add_argument("--slo-scale", type=float, default=1.0,
                   help="multiply both SLOs (TTFT 2 s, TPOT 80 ms) and the sla server's "
                   "targets by this (for a machine too loaded to meet them at all)")
    p.add_argument("--ttft-ms", type=float, default=None,
                   help="the TTFT SLO and target (default 2000 x --slo-scale)")
    p.add_argument("--tpot-ms", type=float, default=None,
                   help="the TPOT SLO and target (default 80 x --slo-scale)")
    p.add_argument("--sla-args", default="--admission-control",
                   help="the sla server's flags besides its targets (one string)")
    p.add_argument("--capacity", type=float, default=None,
                   help="req/s of the fixed server (default: measured first)")
    p.add_argument("--out", default="out/slo_goodput")
    return p.parse_args()


def start(args: argparse.Namespace, extra: str, log: Path) -> tuple[subprocess.Popen, str]:
    return start_server([args.model, *args.server_args.split(), *extra.split()], log)


def bench(args: argparse.Namespace, url: str, label: str, rate: float, num: int,
          path: Path, seed: int = 0) -> dict:
    return bench_serve(url, [
        "--model", args.model, "--endpoint", "chat", "--dataset", "synthetic-chat",
        "--num-prompts", str(num), "--request-rate", str(rate), "--seed", str(seed),
        "--label", label, "--goodput", *args.slos], path, quiet=True)


STEP_TIME_METRICS = ("kvflow:step_time_model_rel_error", "kvflow:step_time_model_abs_error_seconds",
                     "kvflow:step_time_model_predictions_total", "kvflow:requests_rejected_total")


def scrape_step_time_error(url: str) -> dict[str, float]:
    """The step-time model's error (mean relative and absolute, over its recent window), its
    prediction count and the requests refused so far, from the server's /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in STEP_TIME_METRICS:
            found[name.removeprefix("kvflow:")] = float(line.rsplit(" ", 1)[1])
    return found


def load_avg() -> float:
    return os.getloadavg()[0]


def machine_state() -> dict:
    """``uptime`` (the load averages) and the ``lscpu`` lines of the CPU model and flags."""
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
        except OSError:
            return ""

    cpu = [line for line in run(["lscpu"]).splitlines()
           if line.startswith(("Model name", "CPU(s):", "Flags"))]
    return {"uptime": run(["uptime"]).strip(), "lscpu": cpu}


def goodput_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, label in enumerate(("fixed", "sla")):
        pts = sorted((r["rate"], r[label]["request_goodput"]) for r in rows)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}",
                label=f"{label}")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting the TTFT and TPOT SLOs)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def write_results(args: argparse.Namespace, out: Path, rows: list[dict], runs: dict,
                  capacity: float, sla_args: str, machine: dict) -> None:
    """The sweeps, both plots and ``summary.json`` for the loads run so far (rewritten after
    every load, so a run stopped early keeps what it measured)."""
    from kvflow.bench.plot import plot_sweeps

    for label, rs in runs.items():
        with open(out / f"{label}.json", "w") as f:
            json.dump({"label": label, "sweep": rs}, f, indent=1)
    plot_sweeps([(label, rs) for label, rs in runs.items()], str(out / "sweep.png"))
    goodput_plot(rows, out / "goodput.png", f"SLOs {' '.join(args.slos)} ms")
    machine["after"] = machine_state()
    summary = {"capacity_req_s": capacity, "slos_ms": args.slos, "sla_args": sla_args,
               "server_args": args.server_args, "num_prompts": args.num_prompts, "rows": rows,
               "median_ratio": statistics.median(r["ratio"] for r in rows),
               "machine": machine}
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["rows"][-1], indent=1), flush=True)


def main() -> None:
    # a SIGTERM (``timeout``) unwinds through ``finally`` so both servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ttft_ms = args.ttft_ms if args.ttft_ms is not None else 2000 * args.slo_scale
    tpot_ms = args.tpot_ms if args.tpot_ms is not None else 80 * args.slo_scale
    args.slos = [f"ttft:{ttft_ms:g}", f"tpot:{tpot_ms:g}"]
    sla_args = f"--target-tpot-ms {tpot_ms:g} --target-ttft-ms {ttft_ms:g} {args.sla_args}"
    machine = {"before": machine_state()}
    servers = {"fixed": start(args, "", out / "fixed.log"),
               "sla": start(args, sla_args, out / "sla.log")}
    try:
        for proc, url in servers.values():
            wait_ready(proc, url)
        for label, (_, url) in servers.items():  # both warm (the sla model fitted) alike
            bench(args, url, label, 2 * (args.capacity or 1.0), args.warmup_prompts,
                  out / f"warmup_{label}.json", seed=1)  # other prompts than the timed runs
        capacity = args.capacity
        if capacity is None:
            calib = bench(args, servers["fixed"][1], "fixed", float("inf"), args.calib_prompts,
                          out / "calib.json")
            capacity = calib["completed"] / calib["duration"]
        print(f"capacity {capacity:.3f} req/s (load avg {load_avg():.1f})", flush=True)
        rows, runs = [], {"fixed": [], "sla": []}
        for i, load in enumerate(float(x) for x in args.loads.split(",")):
            rate = round(load * capacity, 3)
            per = {"fixed": [], "sla": []}
            for rnd in range(args.rounds):  # who goes first alternates by round and load
                order = ("fixed", "sla") if (rnd + i) % 2 == 0 else ("sla", "fixed")
                for label in order:
                    before = load_avg()
                    r = bench(args, servers[label][1], label, rate, args.num_prompts,
                              out / f"{label}_x{load}_r{rnd}.json")
                    r["load_avg"] = [before, load_avg()]
                    r["step_time_model"] = scrape_step_time_error(servers[label][1])
                    per[label].append(r)
                    print(f"x{load} rate {rate} {label}: good {r['good_requests']}/"
                          f"{r['completed']} goodput {r['request_goodput']:.3f} req/s, "
                          f"p50 TTFT {r['median_ttft_ms']:.0f} ms, p50 TPOT "
                          f"{r['median_tpot_ms']:.1f} ms, failed {r['failed']}, step-time "
                          f"error {r['step_time_model']}, load avg {before:.1f}", flush=True)
            row = {"load": load, "rate": rate}
            for label, results in per.items():
                med = sorted(results, key=lambda r: r["request_goodput"])[len(results) // 2]
                runs[label].append(med)
                row[label] = {k: med[k] for k in ("good_requests", "completed", "failed",
                                                  "request_goodput", "median_ttft_ms",
                                                  "median_tpot_ms", "p99_tpot_ms",
                                                  "output_throughput", "step_time_model",
                                                  "load_avg")}
                row[label]["goodput_rounds"] = [r["request_goodput"] for r in results]
            row["ratio"] = row["sla"]["request_goodput"] / max(row["fixed"]["request_goodput"],
                                                               1e-9)
            rows.append(row)
            print(f"x{load}: goodput sla/fixed = {row['ratio']:.2f}", flush=True)
            write_results(args, out, rows, runs, capacity, sla_args, machine)  # each load
    finally:
        for proc, _ in servers.values():
            stop_server(proc)


if __name__ == "__main__":
    main()
