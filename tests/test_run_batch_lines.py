"""``kvflow run-batch`` without a model: each kind of refused line against its hand-written
error object (kvflow/entrypoints/batch_lines.py), output order and the ``--max-concurrency``
bound with a stand-in endpoint that answers out of order (run_batch.run_lines), the output
file written whole or not at all (batch_files.BatchOutput), and the errors the command gives
before any model loads. The lines run through the real server are in
tests/e2e/test_run_batch.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import stat
import subprocess
import sys
import threading

import pytest

from kvflow.entrypoints.batch_files import BatchFileError, BatchInput, BatchOutput
from kvflow.entrypoints.batch_lines import BatchRequest, LineError, parse_line
from kvflow.entrypoints.run_batch import run_lines

GOOD = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
        "body": {"model": "m", "prompt": "hi"}}


def _line(**changes) -> bytes:
    value = {**GOOD, **changes}
    return json.dumps({k: v for k, v in value.items() if v is not ...}).encode() + b"\n"


def test_a_good_line_is_a_request_and_its_custom_id_is_taken():
    seen: set[str] = set()
    assert parse_line(_line(), 4, seen) == BatchRequest(4, "a", "/v1/completions",
                                                        GOOD["body"])
    assert seen == {"a"}
    # stream false (or absent) is a whole-body request, as the server answers it
    got = parse_line(_line(custom_id="b", body={"prompt": "x", "stream": False}), 5, seen)
    assert isinstance(got, BatchRequest) and got.body == {"prompt": "x", "stream": False}


@pytest.mark.parametrize("body", [
    {"model": "m", "input": "hi"},
    {"input": "hi", "store": True},  # store is the endpoint's: echoed, kept for no one
    {"input": "hi", "store": False, "stream": False},
    {"input": "hi", "previous_response_id": None},  # null: no earlier reply named
    {"input": "hi", "background": False},
])
def test_a_responses_line_is_a_request_as_written(body):
    got = parse_line(_line(url="/v1/responses", body=body), 2, set())
    assert got == BatchRequest(2, "a", "/v1/responses", body)


@pytest.mark.parametrize("url", ["/score", "/rerank", "/v2/rerank"])
def test_the_servers_score_and_rerank_aliases_are_batch_urls(url):
    """vLLM's run-batch takes a url ending in /score or /rerank (its error names /score and
    /rerank); the server serves these paths too, so a line POSTs to the one it names."""
    body = {"query": "q", "documents": ["d"]}
    assert parse_line(_line(url=url, body=body), 3, set()) == BatchRequest(3, "a", url, body)


def test_previous_response_id_elsewhere_is_the_endpoint_s_to_refuse():
    """Only /v1/responses has the field: on another url it is the body's unknown field, for
    the server to answer (a 400 there), not the batch's to refuse."""
    body = {"prompt": "x", "previous_response_id": "resp_1"}
    assert parse_line(_line(body=body), 1, set()) == BatchRequest(1, "a", "/v1/completions",
                                                                 body)


@pytest.mark.parametrize("raw, expected", [
    (b"{not json\n", (None, "invalid_json_line",
                      ("line 7 is not valid JSON: Expecting property name enclosed in double "
                      "quotes (column 2)"), None)),
    # a line missing its closing brace: the column of its end, not 1 of the next line
    (b'{"custom_id": "a", "body": {}\n', (None, "invalid_json_line",
                                         ("line 7 is not valid JSON: Expecting ',' delimiter "
                                          "(column 30)"), None)),
    (b"  \r\n", (None, "invalid_json_line", "line 7 is empty", None)),
    (b'"\xff"\n', (None, "invalid_json_line", "line 7 is not UTF-8 text", None)),
    (b"[1, 2]\n", (None, "invalid_json_line", "line 7 is a JSON list, not an object", None)),
    (_line(custom_id=...), (None, "missing_required_parameter",
                            "line 7 has no 'custom_id': it must be a non-empty string",
                            "custom_id")),
    (_line(custom_id=3), (None, "invalid_value",
                          "line 7: custom_id must be a non-empty string, got 3", "custom_id")),
    (_line(custom_id=""), (None, "invalid_value",
                           'line 7: custom_id must be a non-empty string, got ""',
                           "custom_id")),
    (_line(method=...), ("a", "missing_required_parameter",
                         "line 7 has no 'method': it must be the string 'POST'", "method")),
    (_line(method="GET"), ("a", "invalid_method",
                           "line 7: method 'GET' is not supported; batch requests are POST",
                           "method")),
    (_line(url="/v1/moderations"), ("a", "invalid_url",
                                    ("line 7: url '/v1/moderations' is not supported; use one "
                                    "of /v1/chat/completions, /v1/completions, /v1/embeddings, "
                                    "/v1/responses, /v1/score, /v1/rerank, /v1/classify"), "url")),
    (_line(url="/v1/completions?x=1"), ("a", "invalid_url",
                                        ("line 7: url '/v1/completions?x=1' is not supported; "
                                        "use one of /v1/chat/completions, /v1/completions, "
                                        "/v1/embeddings, /v1/responses, /v1/score, /v1/rerank, "
                                        "/v1/classify"), "url")),
    # GET /v1/responses/{id} is not a batch url (lines are POSTs)
    (_line(url="/v1/responses/resp_1"), ("a", "invalid_url",
                                         ("line 7: url '/v1/responses/resp_1' is not supported; "
                                          "use one of /v1/chat/completions, /v1/completions, "
                                          "/v1/embeddings, /v1/responses, /v1/score, /v1/rerank, "
                                        "/v1/classify"), "url")),
    (_line(url="/v1/responses", body={"input": "x", "stream": True}),
     ("a", "stream_unsupported", ("line 7: batch requests cannot stream; leave body.stream out "
      "or false (got true)"), "body.stream")),
    (_line(url="/v1/responses", body={"input": "x", "previous_response_id": "resp_0a"}),
     ("a", "unsupported_parameter", ("line 7: body.previous_response_id is not supported in a "
      "batch (lines run concurrently and no reply outlives the batch); send the earlier turns "
      'in input instead (got "resp_0a")'), "body.previous_response_id")),
    # a mistyped id is refused the same way: the batch refuses the field, whatever its value
    (_line(url="/v1/responses", body={"input": "x", "previous_response_id": 5}),
     ("a", "unsupported_parameter", ("line 7: body.previous_response_id is not supported in a "
      "batch (lines run concurrently and no reply outlives the batch); send the earlier turns "
      "in input instead (got 5)"), "body.previous_response_id")),
    # a line's output is its finished reply: no background run
    (_line(url="/v1/responses", body={"input": "x", "background": True}),
     ("a", "unsupported_parameter", ("line 7: body.background is not supported in a batch (a "
      "line's output is its finished reply; the batch already runs apart from its caller); "
      "leave it out or false (got true)"), "body.background")),
    # a binary reply cannot be an output line: base64 carries the same bytes
    (_line(url="/v1/embeddings", body={"input": "x", "encoding_format": "bytes"}),
     ("a", "unsupported_value", ('line 7: body.encoding_format "bytes" answers with a binary '
      "body, which an output line (JSON) cannot hold; send base64 (with embed_dtype and "
      "endianness as needed)"), "body.encoding_format")),
    (_line(url="/v1/embeddings", body={"input": "x", "encoding_format": "bytes_only"}),
     ("a", "unsupported_value", ('line 7: body.encoding_format "bytes_only" answers with a '
      "binary body, which an output line (JSON) cannot hold; send base64 (with embed_dtype "
      "and endianness as needed)"), "body.encoding_format")),
    (_line(body=...), ("a", "missing_required_parameter",
                       "line 7 has no 'body': it must be a JSON object", "body")),
    (_line(body=["x"]), ("a", "invalid_value",
                         'line 7: body must be a JSON object, got ["x"]', "body")),
    (_line(body={"prompt": "x", "stream": True}),
     ("a", "stream_unsupported", ("line 7: batch requests cannot stream; leave body.stream out "
      "or false (got true)"), "body.stream")),
    # pydantic would read the string "true" as True: refused too, not streamed
    (_line(body={"prompt": "x", "stream": "true"}),
     ("a", "stream_unsupported", ("line 7: batch requests cannot stream; leave body.stream out "
      'or false (got "true")'), "body.stream")),
])
def test_refused_lines_say_why(raw, expected):
    custom_id, code, message, param = expected
    got = parse_line(raw, 7, set())
    assert got == LineError(7, custom_id, code, message, param)
    out = got.output()
    assert set(out) == {"id", "custom_id", "response", "error"}
    assert re.fullmatch(r"batch_req_[0-9a-f]{32}", out["id"])
    assert out["custom_id"] == custom_id and out["response"] is None
    assert out["error"] == {"code": code, "message": message, "param": param, "line": 7}


@pytest.mark.parametrize("changes, custom_id, message, param", [
    ({"metadata": {"k": "v"}}, "a", ("line 7: unrecognized key metadata: a batch line holds "
     "custom_id, method, url and body only (the request's fields go in body; run-batch "
     "--ignore-unknown-fields ignores such keys)"), "metadata"),
    # a misspelled key is named, not the key it misses
    ({"body": ..., "bdy": {"prompt": "x"}, "uri": "/v1/completions"}, "a",
     ("line 7: unrecognized keys bdy, uri: a batch line holds custom_id, method, url and body "
     "only (the request's fields go in body; run-batch --ignore-unknown-fields ignores such "
     "keys)"), "bdy"),
    ({"custom_id": ..., "customid": "a"}, None, ("line 7: unrecognized key customid: a batch "
     "line holds custom_id, method, url and body only (the request's fields go in body; "
     "run-batch --ignore-unknown-fields ignores such keys)"), "customid"),
])
def test_a_key_beyond_the_four_is_refused_unless_ignored(changes, custom_id, message, param):
    """A line's key other than custom_id / method / url / body was dropped silently (a
    misspelled one reported as the missing key it stood for), where the server refuses a
    body's unknown field; now the line's error names it (code ``unknown_parameter``), and
    under --ignore-unknown-fields the line runs, carrying the names (logged once)."""
    seen: set[str] = set()
    assert parse_line(_line(**changes), 7, seen) == LineError(
        7, custom_id, "unknown_parameter", message, param)
    assert seen == ({"a"} if custom_id else set())
    got = parse_line(_line(**changes), 8, set(), ignore_unknown=True)
    if "body" in changes or "custom_id" in changes:  # still missing the key misspelled
        assert got.code == "missing_required_parameter"
    else:
        assert got == BatchRequest(8, "a", "/v1/completions", GOOD["body"], ("metadata",))


def test_a_repeated_custom_id_is_refused_even_after_a_refused_first_line():
    seen: set[str] = set()
    assert parse_line(_line(method="GET"), 1, seen).code == "invalid_method"
    assert parse_line(_line(), 2, seen) == LineError(
        2, "a", "duplicate_custom_id",
        "line 2: custom_id 'a' was used by an earlier line; each line needs its own",
        "custom_id")


def _run(lines: list[bytes], delays: dict[int, float], max_concurrency: int | None):
    """run_lines over a stand-in endpoint: line ``i`` (1-based) answers after ``delays[i]``
    seconds with its custom_id as the body; -> (written lines, the most lines read but not
    yet written at once, counts)."""
    written, state = [], {"read": 0, "most": 0}

    async def answer(request):
        state["read"] += 1
        state["most"] = max(state["most"], state["read"] - len(written))
        if isinstance(request, LineError):
            return request.output()
        await asyncio.sleep(delays.get(request.line, 0.0))
        return {"id": "x", "custom_id": request.custom_id,
                "response": {"status_code": 400 if request.custom_id == "c" else 200,
                             "request_id": "r", "body": request.custom_id}, "error": None}

    counts = asyncio.run(run_lines(iter(lines), answer, written.append, max_concurrency))
    return written, state["most"], counts


def test_lines_are_written_in_input_order_whatever_order_they_finish_in():
    ids = ["a", "b", "c", "d", "e"]
    lines = [_line(custom_id=i) for i in ids[:2]] + [b"oops\n"] + \
        [_line(custom_id=i) for i in ids[2:]]
    # the first line is the slowest, the last the fastest
    written, most, counts = _run(lines, {1: 0.2, 2: 0.15, 4: 0.1, 5: 0.05}, None)
    assert [w["custom_id"] for w in written] == ["a", "b", None, "c", "d", "e"]
    assert [w["response"]["body"] if w["response"] else w["error"]["line"]
            for w in written] == ["a", "b", 3, "c", "d", "e"]
    assert most == 6  # all read before the first was answered
    assert (counts.succeeded, counts.error_responses, counts.refused) == (4, 1, 1)
    assert counts.summary() == ("kvflow run-batch: 6 lines: 4 succeeded, 2 failed (1 with an "
                                "error response, 1 refused by the batch format)")


def test_max_concurrency_bounds_lines_not_yet_written():
    lines = [_line(custom_id=str(i)) for i in range(8)]
    written, most, _ = _run(lines, {1: 0.1, 5: 0.1}, 3)
    assert [w["custom_id"] for w in written] == [str(i) for i in range(8)]
    assert most == 3


def test_an_answer_is_written_while_the_next_line_is_awaited():
    """A pipe's writer that waits for each answer before sending its next line (stdin fed
    line by line) gets it: the output line is written while the reader waits, not once the
    next line (or the end) comes. The stand-in input sends its second line only once the
    first output line is written (it waited up to 5 s, then gave up, before)."""
    written: list[dict] = []
    first_written = threading.Event()
    sent_after_answer = []

    def lines():
        yield _line(custom_id="a")
        sent_after_answer.append(first_written.wait(timeout=5))
        yield _line(custom_id="b")

    async def answer(request):
        await asyncio.sleep(0.01)
        return {"id": "x", "custom_id": request.custom_id, "error": None,
                "response": {"status_code": 200, "request_id": "r", "body": {}}}

    def write(line):
        written.append(line)
        first_written.set()

    asyncio.run(run_lines(lines(), answer, write))
    assert sent_after_answer == [True]
    assert [w["custom_id"] for w in written] == ["a", "b"]


def test_file_output_appears_whole_at_commit_and_discard_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    out = BatchOutput(str(path))
    out.write({"custom_id": "é"})
    assert path.read_text() == "old\n"  # nothing at the path before commit
    temps = [p for p in os.listdir(tmp_path) if p != "out.jsonl"]
    assert len(temps) == 1 and temps[0].startswith(".out.jsonl.")
    out.commit()
    out.discard()  # after commit: nothing to drop
    assert path.read_text(encoding="utf-8") == '{"custom_id": "é"}\n'
    assert os.listdir(tmp_path) == ["out.jsonl"]
    again = BatchOutput(str(path))
    again.write({"custom_id": "x"})
    again.discard()
    assert path.read_text(encoding="utf-8") == '{"custom_id": "é"}\n'
    assert os.listdir(tmp_path) == ["out.jsonl"]


def test_a_symlink_output_replaces_its_target_and_stays_a_link(tmp_path):
    target = tmp_path / "target.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    out = BatchOutput(str(link))
    out.write({"a": 1})
    assert target.read_text() == "old\n"  # nothing at the target before commit
    out.commit()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == '{"a": 1}\n'
    assert sorted(os.listdir(tmp_path)) == ["link.jsonl", "target.jsonl"]


def test_a_fifo_output_is_written_through_and_stays_a_fifo(tmp_path):
    """A non-regular path (here a FIFO; a device such as /dev/null alike) is written in
    place: renaming a temporary file over it replaced it with a regular file."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    out = BatchOutput(str(fifo))
    out.write({"a": 1})
    out.write({"b": 2})
    out.commit()
    reader.join(timeout=10)
    assert got == ['{"a": 1}\n{"b": 2}\n']
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["out.fifo"]


def test_stdout_output_writes_whole_lines(capsys):
    out = BatchOutput("-")
    out.write({"a": 1})
    assert capsys.readouterr().out == '{"a": 1}\n'  # flushed at once
    out.commit()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_write_names_the_flag_and_the_reason(monkeypatch):
    """stdout on a full device: a BatchFileError (exit status 1, one line), not a
    traceback."""
    full = open("/dev/full", "w")  # noqa: SIM115 - closed below, its flush failing
    monkeypatch.setattr(sys, "stdout", full)
    out = BatchOutput("-")
    with pytest.raises(BatchFileError) as e:
        out.write({"a": 1})
    assert str(e.value) == "-o -: writing failed (No space left on device)"
    monkeypatch.undo()
    with contextlib.suppress(OSError):  # the line is still in its buffer
        full.close()


@pytest.mark.parametrize("data, lines", [
    (b"a\n\nb", [b"a\n", b"\n", b"b"]),
    # blank lines that end the file are dropped (vLLM strips the file); inner ones kept
    (b"a\n \t\nb\n\n  \r\n\n", [b"a\n", b" \t\n", b"b\n"]),
    (b"\n\n", []),
])
def test_input_lines_and_count(tmp_path, data, lines):
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    source = BatchInput(str(path))
    assert source.count_lines() == len(lines)
    assert list(source.lines()) == lines
    source.close()


@pytest.mark.parametrize("flags, message", [
    (["-i", "{missing}", "-o", "{out}"],
     "-i {missing}: cannot read it (No such file or directory)"),
    (["-i", "https://example.com/in.jsonl", "-o", "{out}"],
     ("-i https://example.com/in.jsonl: URLs are not supported; download the file first "
     "(curl -o FILE URL) and pass its path, or '-'")),
    (["-i", "{good}", "-o", "{tmp}"], "-o {tmp}: is a folder; give a file path"),
    (["-i", "{good}", "-o", "{tmp}/no/such/out.jsonl"],
     "-o {tmp}/no/such/out.jsonl: cannot write there (No such file or directory)"),
    (["-i", "{good}", "-o", "{out}", "--max-concurrency", "0"],
     "--max-concurrency 0: must be >= 1"),
    # accepted before, and the lines the engine refused came back as 503s, never retried
    (["-i", "{good}", "-o", "{out}", "--admission-control", "--target-ttft-ms", "1"],
     ("--admission-control is a kvflow serve option: run-batch answers every line (a line "
      "refused with 503 would be lost, never retried)")),
])
def test_command_errors_before_the_model_loads(tmp_path, flags, message):
    """One ``kvflow: error:`` line, exit status 2, no output file; the model folder does
    not exist, so reaching the model would be a different error."""
    good = tmp_path / "in.jsonl"
    good.write_text(json.dumps(GOOD) + "\n")
    names = {"missing": str(tmp_path / "missing.jsonl"), "out": str(tmp_path / "out.jsonl"),
             "good": str(good), "tmp": str(tmp_path)}
    cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "run-batch",
           *[f.format(**names) for f in flags], "--model", str(tmp_path / "no-model")]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"kvflow: error: {message.format(**names)}\n"
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_help_names_every_batch_url_and_the_responses_refusals():
    """``kvflow run-batch --help`` lists the four urls a line may POST to (/v1/responses
    included) and says a /v1/responses previous_response_id is refused, as stream is."""
    import argparse

    from kvflow.entrypoints.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["run-batch"].format_help().split())
    for url in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        assert re.search(rf"(?<![\w/]){re.escape(url)}(?![\w/])", text), url
    assert "stream: true, a /v1/responses previous_response_id" in text
