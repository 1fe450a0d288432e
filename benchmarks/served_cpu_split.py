"""Where a served run's CPU time goes: the API server, the engine core and the load generator.

On a 2-core CPU every CPU-second the API server (HTTP, detokenization, SSE encoding) or the
load generator spends is taken from the engine's GEMMs. This script starts ``kvflow serve``
from each given source tree in turn (``PYTHONPATH`` set to the tree, the same Python), runs
``kvflow bench serve`` (of the first tree, so every tree gets the same load generator) at each
rate, and reads each process's user + system CPU time over the load (``/proc/<pid>/stat``),
from the load generator's announcement of its load (``LOAD_START_LINE``, after its start-up
and probe request) to its exit: the API server, the server's
descendants by process name (kvflow's engine core; vLLM's ``VLLM::EngineCore`` and
``VLLM::Worker``) and the load generator (its rusage less its start-up: imports, tokenizer).
The rest of the machine's busy time over the same interval (``/proc/stat``) is reported as
"other": what else ran (another agent's job) while the run was measured. ``--trees vllm``
runs vLLM CPU from ``--vllm-venv`` as compare_cpu.sh starts it.

Run (the compare_cpu.sh workload, two trees alternating, 2 rounds)::

    .venv/bin/python benchmarks/served_cpu_split.py --trees /work/wt/old . --rounds 2 \\
        --model out/smollm2-hf --dtype bfloat16

It prints one line per (tree, round, rate): output tokens/s, TTFT and TPOT p50 / p99 (ms),
and the CPU seconds of the API server, the engine core, the load generator and the rest of
the machine, then the medians per tree and rate. ``--py-spy PATH`` samples the API server and
the engine core with py-spy during each run and writes flame-graph-ready folded stacks to
``<out>/<tree>-r<round>-<rate>-<process>-<pid>.txt`` (py-spy takes CPU itself: figures of a
profiled run are not throughput figures).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_harness import free_port, stop_server, wait_ready

from kvflow.bench.serve import LOAD_START_LINE

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of process ``pid`` (threads of one name summed)."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat: all but idle, iowait)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / _TICK


def children(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    out, todo = [], children(pid)
    while todo:
        kid = todo.pop()
        out.append(kid)
        todo.extend(children(kid))
    return out


def comm(pid: int) -> str:
    """The process name of ``pid`` ("?" once it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def engine_cpu_s(pids: list[int]) -> dict[str, float]:
    """CPU seconds of the server's descendants by process name (the engine core: kvflow's
    ``python`` child, vLLM's ``VLLM::EngineCor`` and ``VLLM::Worker``)."""
    out: dict[str, float] = {}
    for pid in pids:
        name = comm(pid)
        out[name] = out.get(name, 0.0) + proc_cpu_s(pid)
    return out


def server_command(engine: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """The command line and environment of one engine's server: ``vllm`` (``--vllm-venv``,
    as compare_cpu.sh starts it) or a kvflow source tree."""
    common = ["--served-model-name", "m", "--dtype", args.dtype, "--no-enable-prefix-caching",
              "--host", "127.0.0.1", "--port", str(port)]
    if engine == "vllm":
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="4")
        env.pop("PYTHONPATH", None)
        return [f"{args.vllm_venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                "--model", args.model, *common], env
    return [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", args.model, *common,
            *args.serve_args.split()], dict(os.environ, PYTHONPATH=engine)


def run_one(engine: str, bench_tree: str, args: argparse.Namespace, out: Path, tag: str
            ) -> list[dict]:
    """Start the server of ``engine``, bench each rate, stop it; one record per rate."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, env = server_command(engine, args, port)
    with open(out / f"{tag}-server.log", "wb") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  cwd=bench_tree)
    records = []
    try:
        t0 = time.monotonic()
        wait_ready(server, url, timeout=600)
        print(f"   {tag}: ready after {time.monotonic() - t0:.0f} s", flush=True)
        for i, rate in enumerate(args.rates):
            records.append(bench_rate(server.pid, url, rate, i, bench_tree, args, out,
                                      f"{tag}-{rate}"))
    finally:
        stop_server(server)
    return records


class LoadStart(threading.Event):
    """Set when the load generator prints ``LOAD_START_LINE``; ``no_line`` turns True when its
    output ended without that line (a bench tree from before it)."""
    no_line = False


def watch_for_load_start(stream) -> LoadStart:
    """Read the load generator's stdout (text) in a daemon thread, draining it to the end so
    that the generator never blocks on a full pipe; returns the event of its load start."""
    event = LoadStart()

    def read() -> None:
        for line in stream:
            if line.startswith(LOAD_START_LINE):
                event.set()
        event.no_line = not event.is_set()

    threading.Thread(target=read, daemon=True).start()
    return event


def bench_rate(api: int, url: str, rate: str, seed: int, bench_tree: str,
               args: argparse.Namespace, out: Path, tag: str) -> dict:
    """One ``kvflow bench serve`` run at ``rate`` with the CPU time of every process."""
    result = out / f"{tag}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "bench", "serve", "--base-url", url,
           "--model", "m", "--tokenizer", args.model, "--dataset", "random",
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--request-rate", rate, "--seed", str(seed),
           "--ignore-eos", "--disable-tqdm", "--result-json", str(result)]
    engine = descendants(api)
    spies = []
    if args.py_spy:
        for name, pid in [("api", api)] + [(comm(p).replace(":", ""), p) for p in engine]:
            spies.append(subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pid), "--rate", "200", "--nonblocking",
                 "--format", "raw", "--output", str(out / f"{tag}-{name}-{pid}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
    api0, engine0, threads0 = proc_cpu_s(api), engine_cpu_s(engine), thread_cpu_s(api)
    busy0, wall0 = machine_busy_s(), time.monotonic()
    bench = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=bench_tree), cwd=bench_tree,
                             stdout=subprocess.PIPE, text=True)
    load_started = watch_for_load_start(bench.stdout)
    # The load generator's start-up (imports, tokenizer, its probe request) is not part of the
    # load: its CPU time is read when it announces the load (LOAD_START_LINE) and at the end.
    # A bench tree from before that line: when the API server has used 20 ms of CPU (an idle
    # kvflow API server also reaches that within ~6 s, so such a tree over-counts start-up).
    gen_start = None
    while True:
        pid, status, usage = os.wait4(bench.pid, os.WNOHANG)
        if pid:
            break
        if gen_start is None and (load_started.is_set() or (
                load_started.no_line and proc_cpu_s(api) - api0 > 0.02)):
            gen_start = proc_cpu_s(bench.pid)
            busy0, wall0, api0 = machine_busy_s(), time.monotonic(), proc_cpu_s(api)
            engine0 = engine_cpu_s(engine)
        time.sleep(0.02)
    bench.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - wall0
    busy = machine_busy_s() - busy0
    api_s = proc_cpu_s(api) - api0
    engine_s = {k: v - engine0.get(k, 0.0) for k, v in engine_cpu_s(engine).items()}
    threads = {k: v - threads0.get(k, 0.0) for k, v in thread_cpu_s(api).items()}
    for spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C, not on SIGTERM
        spy.wait()
    gen_s = usage.ru_utime + usage.ru_stime - (gen_start or 0.0)
    core_s = sum(engine_s.values())
    doc = json.loads(result.read_text()) if result.exists() else {}
    return {
        "tag": tag, "rate": rate, "out_tok_s": doc.get("output_throughput", float("nan")),
        "ttft_p50": doc.get("median_ttft_ms"), "ttft_p99": doc.get("p99_ttft_ms"),
        "tpot_p50": doc.get("median_tpot_ms"), "tpot_p99": doc.get("p99_tpot_ms"),
        "failed": doc.get("failed"), "wall_s": wall, "api_cpu_s": api_s, "core_cpu_s": core_s,
        "gen_cpu_s": gen_s, "other_cpu_s": busy - api_s - core_s - gen_s,
        "engine_procs": {k: round(v, 2) for k, v in engine_s.items() if v >= 0.05},
        "api_threads": {k: round(v, 2) for k, v in threads.items() if v >= 0.05},
        "load": os.getloadavg()[0],
    }


def fmt(r: dict) -> str:
    """One record as a line of the report."""
    return (f"{r['tag']:<28} {r['out_tok_s']:7.1f} tok/s  TTFT {r['ttft_p50']:7.0f} / "
            f"{r['ttft_p99']:7.0f}  TPOT {r['tpot_p50']:6.1f} / {r['tpot_p99']:6.1f}  "
            f"CPU s: api {r['api_cpu_s']:5.2f} core {r['core_cpu_s']:6.2f} "
            f"gen {r['gen_cpu_s']:5.2f} other {r['other_cpu_s']:5.2f} "
            f"(wall {r['wall_s']:5.1f}, load {r['load']:.2f})")


def main() -> None:
    """Parse the flags, run every tree in turn per round, print the records and medians."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", default=["."],
                   help="kvflow source trees (TREE:DIR puts DIR on PYTHONPATH after the "
                        "tree); 'vllm' runs vLLM from --vllm-venv")
    p.add_argument("--labels", nargs="+", default=None, help="a name per tree")
    p.add_argument("--vllm-venv", default="/work/vllm-venv")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rates", nargs="+", default=["inf", "4"])
    p.add_argument("--model", default="out/smollm2-hf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--serve-args", default="", help="extra `kvflow serve` flags")
    p.add_argument("--out", default="out/served_cpu_split")
    p.add_argument("--py-spy", default=None, help="py-spy executable: profile each run")
    args = p.parse_args()
    trees = [t if t == "vllm" else ":".join(os.path.abspath(part) for part in t.split(":"))
             for t in args.trees]
    labels = args.labels or [os.path.basename(t.split(":")[0]) or t for t in trees]
    args.model = os.path.abspath(args.model)
    args.vllm_venv = os.path.abspath(args.vllm_venv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"== start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()}")
    records: dict[str, list[dict]] = {label: [] for label in labels}
    for rnd in range(1, args.rounds + 1):
        order = list(zip(trees, labels))
        if rnd % 2 == 0:
            order.reverse()
        for tree, label in order:
            bench_tree = next(t for t in trees if t != "vllm").split(":")[0]
            for r in run_one(tree, bench_tree, args, out, f"{label}-r{rnd}"):
                records[label].append(r)
                print(fmt(r), flush=True)
                print(f"    engine processes {r['engine_procs']}; API threads "
                      f"{r['api_threads']} (CPU s)", flush=True)
    print(f"== end {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()}")
    print("== medians")
    keys = ("out_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "api_cpu_s",
            "core_cpu_s", "gen_cpu_s", "other_cpu_s")
    for rate in args.rates:
        base = None
        for label in labels:
            rs = [r for r in records[label] if r["rate"] == rate]
            med = {k: statistics.median(r[k] for r in rs) for k in keys}
            base = base or med
            print(f"rate {rate:>4} {label:<16} " + "  ".join(f"{k} {med[k]:.2f}" for k in keys)
                  + f"  tok/s vs {labels[0]}: {med['out_tok_s'] / base['out_tok_s']:.3f}x")
    (out / "records.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
