"""``kvflow run-batch`` end to end on the tiny Llama: one batch file (read from stdin) mixing
greedy chat, completion and Responses API requests, requests the server refuses with a 4xx,
and lines the batch format refuses, run by the command in this process (``cli.main``, stdin
and stderr its file descriptors 0 and 2: ``run_batch_here``; the SIGTERM test runs it as its own
process). The oracle for every
line that reaches an endpoint is ``kvflow serve`` with the same flags, sent the same body over
HTTP: same status, same body but for ids and creation times. The refused lines are checked against
hand-written error objects, the output line format field by field."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

MODEL = "tiny"
ENGINE_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128",
               "--block-size", "4", "--max-model-len", "96"]
SERVER_ARGS = [*ENGINE_ARGS, "--served-model-name", MODEL]
CHAT, CMPL, EMBD = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
RESP = "/v1/responses"
URLS = ("/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/score, "
        "/v1/rerank, /v1/classify")

ORACLE_SALT = "tests/e2e/test_run_batch.py"
# (custom_id, url, body) of the lines that reach an endpoint, and the status the server gives
SENT = [
    ("chat-1", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}],
                      "max_tokens": 8, "temperature": 0, "ignore_eos": True}),
    ("cmpl-logprobs", CMPL, {"model": MODEL, "prompt": "the quick brown fox jumps",
                             "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                             "logprobs": 2}),
    ("cmpl-two-prompts", CMPL, {"model": MODEL, "prompt": ["the lazy dog", "prefix caching"],
                                "max_tokens": 5, "temperature": 0, "echo": True}),
    ("chat-n2", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "keys"}],
                       "n": 2, "temperature": 0, "max_tokens": 6, "logprobs": True,
                       "top_logprobs": 2}),
    ("bad-temperature", CMPL, {"model": MODEL, "prompt": "x", "temperature": -1}),
    ("misspelled", CMPL, {"model": MODEL, "prompt": "x", "max_token": 5}),
    ("other-model", CHAT, {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ("embed-text-model", EMBD, {"model": MODEL, "input": "hello"}),
    ("too-long", CMPL, {"model": MODEL, "prompt": "the quick brown fox " * 40}),
    # /v1/responses: store absent (true) and false, each echoed as the server echoes it. Their
    # usage counts prefix-cache hits (chat and completions report none without
    # --enable-prompt-tokens-details): a cache salt no other module sends keeps the shared
    # server's hits to this module's own requests (under pytest-xdist, a worker's server had
    # cached "<system>" from another module's request: 8 cached tokens against the batch's 0)
    ("resp-1", RESP, {"model": MODEL, "instructions": "Be brief.", "input": "hi there",
                      "max_output_tokens": 8, "temperature": 0, "cache_salt": ORACLE_SALT}),
    ("resp-items", RESP, {"model": MODEL, "store": False, "metadata": {"k": "v"},
                          "cache_salt": ORACLE_SALT,
                          "input": [{"role": "user", "content": [
                              {"type": "input_text", "text": "keys"}]}],
                          "max_output_tokens": 6, "temperature": 0}),
    ("resp-truncation", RESP, {"model": MODEL, "input": "x", "truncation": "sometimes"}),
    ("resp-n", RESP, {"model": MODEL, "input": "x", "n": 2}),  # chat's, not a field here
]
STATUS = {"chat-1": 200, "cmpl-logprobs": 200, "cmpl-two-prompts": 200, "chat-n2": 200,
          "bad-temperature": 400, "misspelled": 400, "other-model": 404,
          "embed-text-model": 400, "too-long": 400, "resp-1": 200, "resp-items": 200,
          "resp-truncation": 400, "resp-n": 400}
PREFIX = {CHAT: "chatcmpl-", CMPL: "cmpl-", RESP: "resp_"}


def _envelope(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


# the input file: each refused line (raw text, expected custom_id, code, message, param)
# placed after the sent line of the same index, so order is checked across both kinds
REFUSED = [
    ("{not json", None, "invalid_json_line",
     "is not valid JSON: Expecting property name enclosed in double quotes (column 2)", None),
    ("", None, "invalid_json_line", "is empty", None),
    (_envelope("get", CMPL, {"prompt": "x"}, method="GET"), "get", "invalid_method",
     "method 'GET' is not supported; batch requests are POST", "method"),
    (_envelope("moderations", "/v1/moderations", {"input": "x"}), "moderations",
     "invalid_url", f"url '/v1/moderations' is not supported; use one of {URLS}", "url"),
    (_envelope("stream", CMPL, {"model": MODEL, "prompt": "x", "stream": True}), "stream",
     "stream_unsupported", ("batch requests cannot stream; leave body.stream out or false "
     "(got true)"), "body.stream"),
    (_envelope("chat-1", CMPL, {"model": MODEL, "prompt": "x"}), "chat-1",
     "duplicate_custom_id", ("custom_id 'chat-1' was used by an earlier line; each line "
     "needs its own"), "custom_id"),
    (_envelope("resp-stream", RESP, {"model": MODEL, "input": "x", "stream": True}),
     "resp-stream", "stream_unsupported", ("batch requests cannot stream; leave body.stream "
     "out or false (got true)"), "body.stream"),
    # the first /v1/responses line's reply is stored in the batch's process, but the lines run
    # concurrently: naming another line's reply is refused, whatever the order
    (_envelope("resp-follow-up", RESP, {"model": MODEL, "input": "and?",
                                        "previous_response_id": "resp_0"}),
     "resp-follow-up", "unsupported_parameter", ("body.previous_response_id is not supported "
     "in a batch (lines run concurrently and no reply outlives the batch); send the earlier "
     'turns in input instead (got "resp_0")'), "body.previous_response_id"),
]


def _input_lines() -> list[tuple[str, object]]:
    """(line text, what it expects: the SENT entry or the REFUSED entry), in file order."""
    lines = []
    for i, sent in enumerate(SENT):
        lines.append((_envelope(*sent), sent))
        if i < len(REFUSED):
            lines.append((REFUSED[i][0], REFUSED[i]))
    return lines


@pytest.fixture(scope="module")
def server(start_server, tiny_chat_model):
    """The session's server of ``SERVER_ARGS`` (``start_server.shared``), which
    test_openai_tiny.py (same flags) started: the batch lines' oracle."""
    return start_server.shared(tiny_chat_model, SERVER_ARGS)


_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1"}


def _args(model, out) -> list[str]:
    """``kvflow run-batch``'s arguments: read stdin, write ``out``."""
    return ["-i", "-", "-o", str(out), "--model", model, *SERVER_ARGS]


def _command(model, out) -> list[str]:
    """``kvflow run-batch`` reading stdin, writing ``out``, as its own process."""
    return [sys.executable, "-m", "kvflow.entrypoints.cli", "run-batch", *_args(model, out)]


@pytest.fixture(scope="module")
def batch_run(tiny_chat_model, tmp_path_factory, run_batch_here):
    """The command run once over the input (stdin), ``--max-concurrency 4``, in this process
    (``run_batch_here``; the SIGTERM test below runs it as its own process): (its exit
    status and output text, output lines parsed)."""
    folder = tmp_path_factory.mktemp("run_batch")
    out = folder / "out.jsonl"
    text = "".join(line + "\n" for line, _ in _input_lines())
    proc = run_batch_here([*_args(tiny_chat_model, out), "--max-concurrency", "4"], text, folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def _same(got, want, where="body"):
    """``got`` equals ``want`` (floats within 1e-4: a batch's requests run in other batch
    shapes than the oracle's, one at a time)."""
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _without_ids(body):
    """``body`` less what differs between two runs of one request: its ``id`` and
    ``created`` / ``created_at``, and a Responses output item's ``id`` (``msg_<hex>``)."""
    body = {k: v for k, v in body.items() if k not in ("id", "created", "created_at")}
    if "output" in body:
        for item in body["output"]:
            assert re.fullmatch(r"(msg|rs|fc)_[0-9a-f]{32}", item.pop("id")), item
    return body


def test_one_output_line_per_input_line_in_order(batch_run):
    _, output = batch_run
    expected_ids = [entry[0] if len(entry) == 3 else entry[1] for _, entry in _input_lines()]
    assert [line["custom_id"] for line in output] == expected_ids
    for line in output:
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert re.fullmatch(r"batch_req_[0-9a-f]{32}", line["id"])
    assert len({line["id"] for line in output}) == len(output)


def test_sent_lines_answer_as_the_server_does(batch_run, server):
    _, output = batch_run
    by_line = dict(zip([text for text, _ in _input_lines()], output))
    for custom_id, url, body in SENT:
        got = by_line[_envelope(custom_id, url, body)]
        assert got["error"] is None and set(got["response"]) == {"status_code", "request_id",
                                                                 "body"}
        resp = httpx.post(f"{server.url}{url}", json=body, timeout=60)
        assert resp.status_code == STATUS[custom_id], resp.text
        assert got["response"]["status_code"] == resp.status_code, custom_id
        want, reply = resp.json(), got["response"]["body"]
        if resp.status_code == 200:
            assert reply["id"].startswith(PREFIX[url]) and got["response"]["request_id"] == \
                reply["id"]
            assert isinstance(reply["created_at" if url == RESP else "created"], int)
            _same(_without_ids(reply), _without_ids(want), custom_id)
        else:  # the OpenAI error body, exactly
            assert re.fullmatch(r"req_[0-9a-f]{32}", got["response"]["request_id"])
            assert reply == want, custom_id


def test_responses_lines_echo_store_and_keep_their_reply(batch_run):
    """A /v1/responses line's body echoes ``store`` as sent (absent: true, OpenAI's default)
    and holds its reply as one assistant message; its request_id is the reply's id."""
    _, output = batch_run
    got = {line["custom_id"]: line["response"] for line in output}
    for custom_id, store in (("resp-1", True), ("resp-items", False)):
        body = got[custom_id]["body"]
        assert (body["object"], body["store"]) == ("response", store)
        cut = body["usage"]["output_tokens"] == body["max_output_tokens"]
        assert (body["status"], body["incomplete_details"]) == (
            ("incomplete", {"reason": "max_output_tokens"}) if cut else ("completed", None))
        assert [item["type"] for item in body["output"]] == ["message"]
        assert re.fullmatch(r"resp_[0-9a-f]{32}", got[custom_id]["request_id"])
    assert got["resp-items"]["body"]["metadata"] == {"k": "v"}


def test_refused_lines_carry_their_error(batch_run):
    _, output = batch_run
    for number, ((_, entry), got) in enumerate(zip(_input_lines(), output), 1):
        if len(entry) == 3:
            continue
        _, custom_id, code, message, param = entry
        joiner = " " if message.startswith(("is ", "has ")) else ": "
        assert got["response"] is None and got["custom_id"] == custom_id
        assert got["error"] == {"code": code, "message": f"line {number}{joiner}{message}",
                                "param": param, "line": number}


def test_exit_status_and_summary(batch_run):
    proc, _ = batch_run
    assert proc.stderr.splitlines()[-1] == (
        "kvflow run-batch: 21 lines: 6 succeeded, 15 failed (7 with an error response, "
        "8 refused by the batch format)")
    assert "kvflow: error" not in proc.stderr and "Traceback" not in proc.stderr
    # the progress bar reached the end (stdin: no total known ahead)
    assert "run-batch: 21line " in proc.stderr
    assert proc.stdout == ""


GREETING = ("{% if greeting is defined %}[{{ greeting }}]{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_vllm_chat_flags_reach_the_lines(tiny_chat_model, tmp_path, run_batch_here):
    """vLLM's chat flags work in a batch as on the server: ``--response-role`` names the
    reply's role, ``--default-chat-template-kwargs`` reaches the template (the prompt's
    tokens are the tokenizer's ids of the text the template prints with it; a line's own
    ``chat_template_kwargs`` wins), ``--enable-log-requests --max-log-len`` logs each line."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    hi = [{"role": "user", "content": "hi"}]
    lines = [_envelope(cid, CHAT, {"model": MODEL, "messages": hi, "max_tokens": 2,
                                   "temperature": 0, "return_token_ids": True, **extra})
             for cid, extra in (("default", {}),
                                ("own", {"chat_template_kwargs": {"greeting": "yo"}}))]
    out = tmp_path / "out.jsonl"
    proc = run_batch_here(
        [*_args(tiny_chat_model, out), "--chat-template", GREETING, "--response-role", "bot",
         "--default-chat-template-kwargs", json.dumps({"greeting": "hello"}),
         "--enable-log-requests", "--max-log-len", "3"],
        "".join(line + "\n" for line in lines), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {o["custom_id"]: o["response"]["body"]
           for o in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    for cid, greeting in (("default", "hello"), ("own", "yo")):
        body = got[cid]
        assert body["choices"][0]["message"]["role"] == "bot"
        assert body["prompt_token_ids"] == tok(f"[{greeting}]<user>hi\n<assistant>",
                                               add_special_tokens=False)["input_ids"]
    logged = [x for x in proc.stderr.splitlines() if "received request chatcmpl-" in x]
    assert len(logged) == 2 and all("prompt: '[he'," in x or "prompt: '[yo'," in x
                                    for x in logged), logged  # cut to --max-log-len 3


def test_no_chat_template_names_run_batchs_flag(tiny_llama, tmp_path, run_batch_here):
    """A chat line on a model without a chat template: the line's 400 names
    ``kvflow run-batch --chat-template FILE`` (was ``kvflow serve``'s, a command the user
    did not run)."""
    out = tmp_path / "out.jsonl"
    line = _envelope("c", CHAT, {"model": MODEL, "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "hi"}]})
    proc = run_batch_here(_args(tiny_llama.path, out), line + "\n", tmp_path)
    [got] = map(json.loads, out.read_text(encoding="utf-8").splitlines())
    body = got["response"]["body"]
    assert got["response"]["status_code"] == 400, (body, proc.stderr[-2000:])
    assert body["error"]["code"] == "no_chat_template"
    assert "(kvflow run-batch --chat-template FILE)" in body["error"]["message"]


def test_sigterm_mid_batch_leaves_the_output_path_as_it_was(tiny_chat_model, tmp_path):
    """SIGTERM (Ctrl-C takes the same clean-up) while a line is answered and stdin is still
    open (the reader thread blocked in a read): exit status 143 within seconds, the output path
    untouched, no temporary file left. (Without the handler SIGTERM left the temporary file;
    a reader on sys.stdin.buffer made the interpreter abort at exit, status -6.)"""
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    proc = subprocess.Popen(_command(tiny_chat_model, out), stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_ENV)
    try:
        body = {**SENT[0][2], "max_tokens": 80}  # a line still running at the signal
        proc.stdin.write((_envelope("long", CHAT, body) + "\n").encode())
        proc.stdin.flush()
        seen = b""
        while b"run-batch:" not in seen:  # the bar: the model is loaded, lines are read
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, f"exited early: {seen.decode(errors='replace')[-2000:]}"
            seen += chunk
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143, (seen + proc.stderr.read()).decode(errors="replace")
    finally:
        proc.kill()
        proc.wait()
    assert out.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["out.jsonl"]


EMBED_INPUTS = ["the quick brown fox", "a lazy dog while kvflow pages keys and values", "tokens"]
# the tiny BERT as tests/e2e/test_openai_embeddings.py serves it (no KV cache to size)
BERT_ARGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "4",
             "--served-model-name", "bert", "--max-num-batched-tokens", "64"]


def test_embeddings_lines_match_sentence_transformers(built_models, tiny_tokenizer, tmp_path,
                                                      run_batch_here):
    """/v1/embeddings lines on a tiny random BERT (mean pooling), against
    sentence-transformers: float and base64 vectors in input order, one input or several,
    usage counted in tokens; ``dimensions`` on a model without Matryoshka is the 400 the
    server gives (param ``dimensions``)."""
    import base64

    import numpy as np
    import torch

    from tests.models.embedding_models import build_bert, st_embed

    folder, st = built_models("bert", lambda f: build_bert(tiny_tokenizer, f, "mean"))
    lines = [_envelope("one", EMBD, {"model": "bert", "input": EMBED_INPUTS[0],
                                     "encoding_format": "float"}),
             _envelope("many", EMBD, {"model": "bert", "input": EMBED_INPUTS}),
             _envelope("b64", EMBD, {"input": EMBED_INPUTS[1], "encoding_format": "base64"}),
             _envelope("dims", EMBD, {"input": EMBED_INPUTS[2], "dimensions": 8})]
    out = tmp_path / "out.jsonl"
    proc = run_batch_here(["-i", "-", "-o", str(out), "--model", folder, *BERT_ARGS,
                           "--no-progress"], "".join(line + "\n" for line in lines), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {line["custom_id"]: line["response"] for line in
           map(json.loads, out.read_text().splitlines())}
    expected = st_embed(st, EMBED_INPUTS)

    def close(vector, ref):
        torch.testing.assert_close(torch.tensor(vector), ref, atol=2e-5, rtol=1e-4)

    assert got["one"]["status_code"] == 200 and got["one"]["body"]["model"] == "bert"
    close(got["one"]["body"]["data"][0]["embedding"], expected[0])
    many = got["many"]["body"]
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    for d, ref in zip(many["data"], expected):
        close(d["embedding"], ref)
    tokens = sum(len(tiny_tokenizer.encode(s)) for s in EMBED_INPUTS)
    assert many["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    packed = base64.b64decode(got["b64"]["body"]["data"][0]["embedding"])
    close(np.frombuffer(packed, dtype="<f4").tolist(), expected[1])
    assert got["dims"]["status_code"] == 400
    assert got["dims"]["body"]["error"]["param"] == "dimensions"
    assert proc.stderr.splitlines()[-1] == ("kvflow run-batch: 4 lines: 3 succeeded, 1 failed "
                                            "(1 with an error response, 0 refused by the "
                                            "batch format)")
