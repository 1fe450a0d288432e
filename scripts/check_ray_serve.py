"""Kill (or, with ``--stop``, SIGSTOP) one Ray worker actor under ``kvflow serve
--distributed-executor-backend ray`` and check what docs/parallel/engine-liveness.md says
follows (docs/parallel/ray.md, "Checks").

Starts the server (no ``RAY_ADDRESS``: it starts a local Ray cluster), asks for one greedy
completion, SIGKILLs one ``ray::RayWorkerWrapper`` process descended from the server, then:

* ``--engine-failure exit``: the server, sent no request, exits with status 1 within seconds
  (the idle engine core's periodic check finds the dead actor; a stopped one by its missing
  heartbeats: ``--stop`` adds ``--worker-heartbeat-timeout 3``);
* ``--engine-failure restart``: the server serves again, the same greedy text.

Either way it then stops the server (SIGINT) and checks that no process of its Ray cluster is
left. Prints what it saw; exit status 0 when all held, 1 otherwise. About 1 minute on 2 cores.

Usage: python scripts/check_ray_serve.py MODEL exit|restart [PORT] [--stop]
       [-- extra serve args]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

RAY_NAMES = ("raylet", "gcs_server", "ray::", "default_worker.py", "log_monitor.py",
             "dashboard", "runtime_env/agent")


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True,
                         check=True)
    procs = {}
    for line in out.stdout.splitlines():
        pid, ppid, args = (line.split(None, 2) + [""])[:3]
        procs[int(pid)] = (int(ppid), args)
    return procs


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of ``root``'s descendants."""
    procs, found, todo = _procs(), {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, args) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = args
                todo.append(pid)
    return found


def _post(port: int, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, ConnectionError) as e:
        return 0, {"error": str(e)}


def _wait_ready(server: subprocess.Popen, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return True
        except (urllib.error.URLError, ConnectionError):
            time.sleep(1)
    return False


def _after_kill(server: subprocess.Popen, port: int, body: dict, failure: str,
                text: str) -> bool:
    """What follows the kill, as the docs say (printed); whether it held."""
    killed = time.monotonic()
    if failure == "exit":  # idle: the engine core's periodic check finds the dead actor
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        print(f"server exit status {code}, {time.monotonic() - killed:.1f} s after the kill "
              "(no request sent)")
        return code == 1
    for _ in range(180):
        status, reply = _post(port, body)
        if status == 200:
            again = reply["choices"][0]["text"]
            print(f"served again {time.monotonic() - killed:.1f} s after the kill; same text: "
                  f"{again == text}")
            return again == text
        time.sleep(1)
    return False


def main(argv: list[str]) -> int:
    head = argv[:argv.index("--")] if "--" in argv else argv
    stop = "--stop" in head
    head = [a for a in head if a != "--stop"]
    model, failure = head[0], head[1]
    port = int(head[2]) if len(head) > 2 else 8471
    extra = argv[argv.index("--") + 1:] if "--" in argv else ["--tensor-parallel-size", "2"]
    if stop:
        extra = [*extra, "--worker-heartbeat-timeout", "3"]
    cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", model, "--port", str(port),
           "--dtype", "float32", "--distributed-executor-backend", "ray",
           "--engine-failure", failure, *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    ray_pids: dict[int, str] = {}
    ok = False
    try:
        if not _wait_ready(server, port, 300):
            print("the server did not start")
            return 1
        body = {"model": model, "prompt": "the cat sat", "max_tokens": 16, "temperature": 0}
        status, reply = _post(port, body)
        text = reply["choices"][0]["text"]
        tree = _descendants(server.pid)
        ray_pids = {p: a for p, a in tree.items() if any(n in a for n in RAY_NAMES)}
        actors = sorted(p for p, a in tree.items() if a.startswith("ray::RayWorkerWrapper"))
        print(f"completion {status} {text!r}; worker actors {actors}")
        os.kill(actors[-1], signal.SIGSTOP if stop else signal.SIGKILL)
        ok = _after_kill(server, port, body, failure, text)
    finally:
        if server.poll() is None:  # the restarted replica's Ray cluster too
            ray_pids.update({p: a for p, a in _descendants(server.pid).items()
                             if any(n in a for n in RAY_NAMES)})
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                print("the server did not stop on SIGINT: killed")
                os.killpg(server.pid, signal.SIGKILL)
                ok = False
        time.sleep(2)
        left = [p for p in ray_pids if p in _procs()]
        print(f"server exit status {server.returncode}; Ray processes left: {left}")
        ok = ok and not left
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
