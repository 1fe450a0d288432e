"""``kvflow serve --shutdown-timeout 20`` (vLLM's flag) on SIGTERM with a stream in flight: new
requests get 503 ``server_shutting_down`` at once while the stream runs to its end (all its
tokens, finish_reason length, ``[DONE]``, no error event), then the server exits by the signal.
The engine core is stopped (SIGSTOP) from the stream's first token until the server has said
it waits, so the stream cannot end before the signal however fast the machine (as in
tests/e2e/test_engine_faults.py); without the flag the same stream is aborted
(test_sigterm_aborts_open_requests there)."""

from __future__ import annotations

import json
import os
import signal

import httpx

from tests.e2e.test_engine_faults import core_pid, wait_for

ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "96", "--block-size", "4",
        "--max-num-seqs", "4", "--uvicorn-log-level", "info", "--shutdown-timeout", "20"]
LONG = {"prompt": "the quick brown fox", "max_tokens": 40, "ignore_eos": True,
        "stream": True, "return_token_ids": True}


def prestart_servers(fixture):
    """This module's server, started ahead (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


def test_sigterm_drains_the_open_stream(server):
    core = core_pid(server.proc.pid)
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        events.append(json.loads(next(lines)[6:]))  # generating
        os.kill(core, signal.SIGSTOP)
        try:
            server.terminate()
            wait_for(lambda: "waiting up to 20 s for 1 open request(s)" in server.log(),
                     timeout=10)
            refused = httpx.post(f"{server.url}/v1/completions", timeout=10,
                                 json={"prompt": "hi", "max_tokens": 2})
        finally:
            os.kill(core, signal.SIGCONT)
        events += [{"done": True} if line == "data: [DONE]" else json.loads(line[6:])
                   for line in lines]
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert events[-1] == {"done": True}
    assert not any("error" in e for e in events), events[-3:]
    choices = [c for e in events[:-1] for c in e["choices"]]
    assert sum(len(c.get("token_ids") or []) for c in choices) == 40
    assert choices[-1]["finish_reason"] == "length"
    assert server.proc.wait(30) == -signal.SIGTERM, server.log()
    assert "aborted" not in server.log()  # nothing was left to abort
