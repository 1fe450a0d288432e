"""``kvflow serve`` flags: generated from ServerConfig and EngineConfig, the positional model,
the KVFLOW_API_KEY fallback, and validation."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.cli import build_parser


def _parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_reach_both_configs():
    args = _parse("some/model", "--port", "9001", "--api-key", "k", "--max-waiting-requests",
                  "3", "--served-model-name", "m", "--block-size", "8", "--max-n", "4")
    server = ServerConfig.from_cli_args(args, env={})
    assert (server.port, server.api_key, server.max_waiting_requests) == (9001, ("k",), 3)
    assert (server.served_model_name, server.max_n, server.host) == (("m",), 4, "127.0.0.1")
    assert server.model_names("some/model") == ("m",)
    aliased = ServerConfig.from_cli_args(_parse("--served-model-name", "m", "alias"), env={})
    assert aliased.model_names("some/model") == ("m", "alias")
    assert ServerConfig.from_cli_args(_parse(), env={}).model_names("some/model") == \
        ("some/model",)
    assert ServerConfig(served_model_name="one").served_model_name == ("one",)  # config file
    assert args.model_tag == "some/model"
    assert EngineConfig.from_cli_args(args).cache_config.block_size == 8


def test_api_key_falls_back_to_the_environment():
    assert ServerConfig.from_cli_args(_parse(), env={"KVFLOW_API_KEY": "e"}).api_key == ("e",)
    assert ServerConfig.from_cli_args(_parse("--api-key", "f"),
                                      env={"KVFLOW_API_KEY": "e"}).api_key == ("f",)
    assert ServerConfig.from_cli_args(_parse(), env={}).api_key is None


def test_api_key_falls_back_to_vllms_variable():
    """vLLM's server takes its key from VLLM_API_KEY when no --api-key is given; kvflow read
    KVFLOW_API_KEY only, so a deployment keeping its key in VLLM_API_KEY was served with
    every route open. Either variable sets it; both alike are one key; a flag wins."""
    assert ServerConfig.from_cli_args(_parse(), env={"VLLM_API_KEY": "v"}).api_key == ("v",)
    assert ServerConfig.from_cli_args(
        _parse(), env={"VLLM_API_KEY": "v", "KVFLOW_API_KEY": "v"}).api_key == ("v",)
    assert ServerConfig.from_cli_args(_parse("--api-key", "f"),
                                      env={"VLLM_API_KEY": "v"}).api_key == ("f",)
    with pytest.raises(ValueError, match=r"^KVFLOW_API_KEY and VLLM_API_KEY are set to "
                                         r"different keys"):
        ServerConfig.from_cli_args(_parse(), env={"VLLM_API_KEY": "v", "KVFLOW_API_KEY": "k"})
    with pytest.raises(ValueError, match=r"^VLLM_API_KEY=' ' is empty"):
        ServerConfig.from_cli_args(_parse(), env={"VLLM_API_KEY": " "})


@pytest.mark.parametrize("kwargs,field", [({"port": 70000}, "port"), ({"max_n": 0}, "max_n"),
                                          ({"responses_store_size": -1}, "responses_store_size"),
                                          ({"max_waiting_requests": -1},
                                           "max_waiting_requests"),
                                          ({"uvicorn_log_level": "loud"}, "uvicorn_log_level"),
                                          ({"timeout_keep_alive": 0}, "timeout_keep_alive"),
                                          ({"max_request_body_size": "0"},
                                           "max_request_body_size"),
                                          ({"max_request_body_size": "lots"},
                                           "max_request_body_size"),
                                          ({"max_waiting_requests": 0},
                                           "max_waiting_requests"),
                                          ({"api_key": ""}, "api_key"),
                                          ({"served_model_name": " "}, "served_model_name"),
                                          ({"served_model_name": []}, "served_model_name"),
                                          ({"served_model_name": ["a", "a"]},
                                           "served_model_name"),
                                          ({"lora_modules": ["a="]}, "lora_modules"),
                                          ({"lora_modules": ["a=/x", "a=/y"]},
                                           "lora_modules")])
def test_bad_server_options(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**kwargs)


@pytest.mark.parametrize("flag,size", [(None, 32 * 2**20), ("4MiB", 4 * 2**20),
                                       ("1000000", 10**6), ("2MB", 2 * 10**6)])
def test_max_request_body_size(flag, size):
    """``--max-request-body-size`` in bytes (hand-computed); 32 MiB by default."""
    args = _parse() if flag is None else _parse("--max-request-body-size", flag)
    assert ServerConfig.from_cli_args(args, env={}).max_request_body_bytes == size


@pytest.mark.parametrize("flags,needle", [
    (["--lora-modules", "a=/x"], "needs --enable-lora"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"],
     "named like the served model 'm'"),
])
def test_lora_modules_refused_before_the_model_loads(monkeypatch, capsys, flags, needle):
    """--lora-modules without --enable-lora, or named like the base model: one line, exit 2,
    and no engine started (was a traceback after loading, exit 3)."""
    from kvflow.engine import async_llm
    from kvflow.entrypoints.cli import main

    def no_engine(*args, **kw):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_engine)
    # port 0: the check must not depend on 8000 being free on the test machine
    rc = main(["serve", "SmolLM2-135M-Instruct", "--port", "0", *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize("taken", [False, True], ids=["host_unresolved", "port_in_use"])
def test_listen_address_checked_before_the_model_loads(monkeypatch, capsys, taken):
    """A --host that does not resolve, or a --port another socket listens on: one line naming
    the flag, exit 2, no engine started (was an error from uvicorn after the model loaded)."""
    import socket

    from kvflow.engine import async_llm
    from kvflow.entrypoints.cli import main

    def no_engine(*args, **kw):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_engine)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = str(other.getsockname()[1])
        flags = ["--port", port] if taken else ["--host", "no-such-host.invalid"]
        rc = main(["serve", "SmolLM2-135M-Instruct", *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    needle = f"--host 127.0.0.1 --port {port}: cannot listen there" if taken else \
        "--host no-such-host.invalid: cannot resolve it"
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvflow: error: ") \
        and needle in err[0], err


@pytest.mark.parametrize("flags, needle", [
    (["--tensor-parallel-size", "2", "--cpu-threads-bind", "SHARED"],
     "to more than one worker process"),
    (["--max-model-len", "10000000"], "--max-model-len=10000000 exceeds the positions"),
], ids=["cpu_threads_bind", "max_model_len"])
def test_engine_start_up_error_is_the_only_line(tiny_llama, caplog, capfd, flags, needle):
    """A configuration error the engine-core process finds (a --cpu-threads-bind CPU given to
    both tensor-parallel ranks, checked before any worker starts; a --max-model-len beyond
    the model's positions): the error line alone on stderr, the core's included (``engine
    core process started`` was logged at INFO before it; the max_model_len check came after
    the workers had loaded the weights, with their INFO lines). A CPU outside the affinity
    mask, once found there too, is refused by EngineConfig in the CLI process now
    (tests/test_cpu_threads.py)."""
    import logging
    import os

    from kvflow.entrypoints.cli import main

    cpu = min(os.sched_getaffinity(0))
    flags = [f"{cpu}|{cpu}" if f == "SHARED" else f for f in flags]
    level = logging.getLogger("kvflow").level
    try:
        with caplog.at_level(logging.INFO):
            rc = main(["serve", tiny_llama.path, "--device", "cpu", "--port", "0", *flags])
    finally:
        logging.getLogger("kvflow").setLevel(level)
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvflow: error: ") and \
        needle in err[0], err
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []


def test_lora_sizes_without_enable_lora_are_refused():
    """--max-loras / --max-lora-rank only size LoRA slots: without --enable-lora they would be
    ignored, so they are refused (the defaults pass)."""
    from kvflow.config import LoRAConfig

    for kwargs in ({"max_loras": 3}, {"max_lora_rank": 8}):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))}=.* needs enable_lora"):
            EngineConfig.from_kwargs(**kwargs)
        assert LoRAConfig(enable_lora=True, **kwargs).enable_lora
    assert not EngineConfig.from_kwargs().lora_config.enable_lora


def test_cancelled_requests_are_not_logged_with_a_traceback_on_shutdown():
    """Once ``kvflow serve`` shuts down, what uvicorn cancels (a request left after its 5 s
    graceful timeout or a second Ctrl-C, and the lifespan task) is not logged as ~50 lines of
    traceback each (benchmarks/server_signals.py sigint-twice found two); other errors are."""
    import asyncio
    import logging

    from kvflow.entrypoints.server_shutdown import drop_cancelled_tracebacks

    def record(msg: str, error: BaseException | None = None) -> logging.LogRecord:
        info = (type(error), error, None) if error is not None else None
        return logging.LogRecord("uvicorn.error", logging.ERROR, "f", 1, msg, None, info)

    assert not drop_cancelled_tracebacks(record("Exception in ASGI application\n",
                                                asyncio.CancelledError()))
    assert not drop_cancelled_tracebacks(record("x", KeyboardInterrupt()))
    lifespan = ("Traceback (most recent call last):\n  File \"q.py\", line 158, in get\n"
                "asyncio.exceptions.CancelledError\n")
    assert not drop_cancelled_tracebacks(record(lifespan))
    assert drop_cancelled_tracebacks(record("Exception in ASGI application\n",
                                            ValueError("a real bug")))
    assert drop_cancelled_tracebacks(record(lifespan.replace("CancelledError", "OSError")))
    assert drop_cancelled_tracebacks(record("Cancel 1 running task(s), timeout graceful "
                                            "shutdown exceeded"))


def test_sigterm_while_the_model_loads_unwinds_then_ends_by_sigterm(monkeypatch):
    """SIGTERM before uvicorn serves (the model loading) raises KeyboardInterrupt inside the
    start-up, so it unwinds as for Ctrl-C (the engine's processes and folders cleaned up),
    then the process ends by SIGTERM (was: SIGTERM's default action ended the API process
    alone, the engine-core and worker processes left loading; benchmarks/server_signals.py
    sigterm-loading). The installed handler is called directly; ending by the signal is
    faked."""
    import signal

    from kvflow.entrypoints import server_shutdown

    raised, unwound = [], []
    monkeypatch.setattr(server_shutdown.signal, "raise_signal", raised.append)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), server_shutdown.sigterm_stops_loading():
        try:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        finally:
            unwound.append(raised.copy())  # the start-up's cleanup runs first
    assert unwound == [[]] and raised == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(KeyboardInterrupt), server_shutdown.sigterm_stops_loading():
        raise KeyboardInterrupt  # Ctrl-C: no SIGTERM raised
    assert raised == [signal.SIGTERM]


def test_server_stopped_by_an_ignored_signal_still_ends_as_signalled(monkeypatch):
    """A server started with SIGINT ignored (``kvflow serve ... &`` in a script: a background
    job of a non-interactive shell) still stops on SIGINT (uvicorn installs its handler), but
    uvicorn's re-raise then went to the ignored handler and ``kvflow serve`` exited 0 instead
    of 130. ``end_as_signalled`` raises KeyboardInterrupt for it, and ends by SIGTERM for an
    ignored SIGTERM (faked here); a signal whose handler acts (uvicorn re-raised it already)
    and a stop without a signal change nothing."""
    import signal

    from kvflow.entrypoints import server_shutdown

    raised = []
    monkeypatch.setattr(server_shutdown.signal, "raise_signal", raised.append)
    server = server_shutdown.AbortingServer.__new__(server_shutdown.AbortingServer)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Python's own SIGINT handler, set here: a suite started with SIGINT ignored (a
        # background job of a non-interactive shell, `trap '' INT`) inherits SIG_IGN, and the
        # first call below then raised KeyboardInterrupt into pytest, ending the whole run
        signal.signal(signal.SIGINT, signal.default_int_handler)
        server._captured_signals = [signal.SIGINT]
        server.end_as_signalled()  # the SIGINT handler acts: nothing to do
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with pytest.raises(KeyboardInterrupt):
            server.end_as_signalled()
        server._captured_signals = [signal.SIGTERM]
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.end_as_signalled()
        assert raised == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        server._captured_signals = []
        server.end_as_signalled()
        assert raised == [signal.SIGTERM]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("value", ["", " "])
def test_empty_api_key_in_the_environment_is_refused(value):
    """README: an empty key is refused at start (it would leave the server open); an empty
    KVFLOW_API_KEY used to be read as no key at all, serving every route without one."""
    with pytest.raises(ValueError, match=r"KVFLOW_API_KEY=.* is empty"):
        ServerConfig.from_cli_args(_parse(), env={"KVFLOW_API_KEY": value})
    # a key typed on the command line wins over the variable, empty or not
    assert ServerConfig.from_cli_args(_parse("--api-key", "k"),
                                      env={"KVFLOW_API_KEY": value}).api_key == ("k",)


def test_empty_api_key_variable_is_one_line_before_loading(monkeypatch, capsys):
    from kvflow.entrypoints.cli import main

    monkeypatch.setenv("KVFLOW_API_KEY", "")
    rc = main(["serve", "/nonexistent/model", "--port", "0"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvflow: error: KVFLOW_API_KEY='' is empty"), lines[0]


def test_a_refused_api_key_list_does_not_print_its_good_key(capsys):
    """``--api-key s3cret ""`` is refused for its empty key; the error line used to quote the
    whole tuple, ``--api-key=('s3cret', '') is invalid``, writing the good key to the
    terminal (and any log of the start-up). It shows the keys as a list, good ones masked."""
    from kvflow.entrypoints.cli import main

    with pytest.raises(ValueError) as e:
        ServerConfig(api_key=["s3cret", " "])
    assert str(e.value).startswith("api_key=['***', ' '] is invalid: it must not be empty")
    rc = main(["serve", "/nonexistent/model", "--port", "0", "--api-key", "s3cret", ""])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvflow: error: --api-key=['***', ''] is invalid"), lines[0]
    assert "s3cret" not in lines[0]


def test_a_refused_list_flag_is_quoted_as_a_list():
    """A flag of several values is quoted as the list typed, not as Python's tuple."""
    with pytest.raises(ValueError, match=r"^served_model_name=\['a', 'a'\] is invalid: it "
                                         r"names a model twice$"):
        ServerConfig(served_model_name=["a", "a"])


def test_lora_modules_take_vllms_json_form():
    """vLLM's ``--lora-modules '{"name": ..., "path": ...}'`` (its LoRAParserAction) was
    refused as not NAME=PATH; it is the same adapter as ``NAME=PATH`` (hand-written pairs),
    mixed with the other form too. Other keys (vLLM's base_model_name) are refused by name."""
    args = _parse("--lora-modules", '{"name": "sql", "path": "/a/sql"}', "chat=/a/chat")
    assert ServerConfig.from_cli_args(args, env={}).lora_modules == ("sql=/a/sql",
                                                                     "chat=/a/chat")
    for module, needle in [('{"name": "a", "path": "/x", "base_model_name": "m"}',
                            "base_model_name is not supported"),
                           ('{"name": "a"}', "needs a non-empty string name"),
                           ('{"name": "a=b", "path": "/x"}', "without '='"),
                           ('{"name": "a", "path": 5}', "needs a non-empty string name"),
                           ('{"name": ', "is not valid JSON"),
                           ('{"name": "a", "path": "/x"}', None)]:
        if needle is None:  # the same name twice in the two forms
            with pytest.raises(ValueError, match="names an adapter twice"):
                ServerConfig(lora_modules=[module, "a=/y"])
            continue
        with pytest.raises(ValueError, match=f"^lora_modules: .*{needle}"):
            ServerConfig(lora_modules=[module])


def test_lora_modules_in_a_config_file():
    """A config file's lora_modules: one NAME=PATH string was cut into characters, a mapping
    or a number raised AttributeError; now one adapter, the JSON form's mapping, a
    ValueError."""
    assert ServerConfig(lora_modules="a=/x").lora_modules == ("a=/x",)
    assert ServerConfig(lora_modules=[{"name": "a", "path": "/x"}]).lora_modules == ("a=/x",)
    with pytest.raises(ValueError, match=r"^lora_modules: 5 must be NAME=PATH or"):
        ServerConfig(lora_modules=[5])


def test_structured_outputs_config_takes_enable_in_reasoning_only():
    """vLLM's --structured-outputs-config: kvflow reads enable_in_reasoning (a bool); another
    key or value is refused, named."""
    from kvflow.config.server import ServerConfig

    on = ServerConfig(structured_outputs_config='{"enable_in_reasoning": true}')
    assert on.structured_outputs_config == {"enable_in_reasoning": True}
    assert ServerConfig().structured_outputs_config is None
    for value, message in (('{"backend": "xgrammar"}', "key 'backend' is not supported"),
                           ('{"enable_in_reasoning": 1}', "enable_in_reasoning=1 must be true"),
                           ("[1]", "must be a JSON object")):
        with pytest.raises(ValueError, match=message):
            ServerConfig(structured_outputs_config=value)
