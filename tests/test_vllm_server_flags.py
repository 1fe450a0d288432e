"""vLLM's ``vllm serve`` server flags on ``kvflow serve`` (README "Coming from vLLM"): parsed
into ServerConfig (values hand-computed from the command line), and their effect on the app
``build_app`` makes, seen through FastAPI's TestClient over a stand-in engine (the routes used
here never reach it): CORS preflight headers, the served docs, X-Request-Id; refusals name the
flag and why."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kvflow import __version__
from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.http_options import check_ssl_files, uvicorn_options


def _config(*argv: str) -> ServerConfig:
    return ServerConfig.from_cli_args(build_parser().parse_args(["serve", *argv]), env={})


def _client(config: ServerConfig, **kwargs) -> TestClient:
    from kvflow.entrypoints.api_server import build_app

    engine = SimpleNamespace(config=EngineConfig(), is_healthy=True)
    return TestClient(build_app(engine, config, "m"), **kwargs)


def test_vllm_command_line_parses():
    """The command line of the bug report, and vLLM's JSON-list and JSON-object forms."""
    config = _config("--model", "M", "--enable-auto-tool-choice", "--tool-call-parser",
                     "hermes", "--allowed-origins", '["http://a.example", "http://b.example"]',
                     "--allowed-methods", "GET", "--allowed-methods", "POST",
                     "--allow-credentials",
                     "--root-path", "/llm", "--disable-fastapi-docs", "--response-role", "bot",
                     "--default-chat-template-kwargs", '{"enable_thinking": false}',
                     "--enable-force-include-usage", "--enable-request-id-headers",
                     "--disable-log-requests",
                     "--chat-template-content-format", "string")
    assert config.enable_auto_tool_choice is True and config.tool_call_parser == "hermes"
    assert config.allowed_origins == ("http://a.example", "http://b.example")
    assert config.allowed_methods == ("GET", "POST") and config.allowed_headers is None
    assert config.allow_credentials is True and config.cors_enabled
    assert (config.root_path, config.disable_fastapi_docs) == ("/llm", True)
    assert config.response_role == "bot"
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert config.enable_force_include_usage and config.enable_request_id_headers
    assert config.log_requests is False and config.max_log_len is None
    assert config.chat_template_content_format == "string"
    defaults = _config()
    assert not defaults.cors_enabled and defaults.response_role == "assistant"
    assert defaults.log_requests is False and defaults.enable_auto_tool_choice is None
    assert _config("--enable-log-requests").log_requests is True
    assert _config("--no-disable-log-requests").log_requests is True
    assert _config("--no-enable-log-requests").log_requests is False
    assert _config("--enable-log-requests", "--max-log-len", "100").max_log_len == 100


@pytest.mark.parametrize("argv,needle", [
    (["--no-enable-auto-tool-choice"], "--no-enable-auto-tool-choice is refused"),
    (["--enable-log-requests", "--disable-log-requests"], "contradict"),
    (["--no-enable-log-requests", "--no-disable-log-requests"], "contradict"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs needs --ssl-certfile"),
    (["--root-path", "llm"], "must start with '/'"),
    (["--max-log-len", "100"], "without it no request is logged"),  # it would be ignored
    (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--default-chat-template-kwargs", "{bad"], "is not a JSON object"),
    (["--allowed-origins", "[1]"], "must be a list of strings"),
    (["--default-chat-template-kwargs", '{"tools": []}'], "may not set ['tools']"),
])
def test_refused_before_the_model_loads(monkeypatch, capsys, argv, needle):
    """One line, exit status 2, and no engine started."""
    from kvflow.engine import async_llm

    def no_engine(*args, **kw):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_engine)
    monkeypatch.setattr("kvflow.entrypoints.api_server.check_listen_address",
                        lambda host, port: None)
    rc = main(["serve", "SmolLM2-135M-Instruct", "--port", "0", *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_cors_preflight_and_simple_request():
    client = _client(_config("--allowed-origins", '["http://a.example"]',
                             "--allowed-methods", "GET", "--api-key", "k"))
    preflight = client.options("/v1/models", headers={
        "Origin": "http://a.example", "Access-Control-Request-Method": "GET"})
    # answered by CORS before the API key is asked for (a browser sends no key on preflight)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://a.example"
    assert preflight.headers["access-control-allow-methods"] == "GET"
    other = client.options("/v1/models", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # an OpenAI error body, as every 4xx (starlette's was the text "Disallowed CORS origin")
    assert other.json() == {"error": {
        "message": "the CORS preflight was refused: its origin is not allowed (origin: "
                   "--allowed-origins)", "type": "invalid_request_error", "param": None,
        "code": "cors_preflight_refused"}}
    assert other.headers["access-control-allow-methods"] == "GET"  # starlette's headers kept
    both = client.options("/v1/models", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "DELETE"})
    assert both.status_code == 400 and both.json()["error"]["message"] == (
        "the CORS preflight was refused: its origin and method are not allowed (origin: "
        "--allowed-origins, method: --allowed-methods)")
    refused = client.get("/v1/models", headers={"Origin": "http://a.example"})
    assert refused.status_code == 401  # the key is still needed; the browser may read why
    assert refused.headers["access-control-allow-origin"] == "http://a.example"


def test_no_cors_headers_by_default():
    response = _client(_config()).get("/health", headers={"Origin": "http://a.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_any_origin_with_credentials_only():
    """--allow-credentials alone turns CORS on with vLLM's '*' defaults; Starlette then echoes
    the caller's origin, as browsers refuse '*' with credentials."""
    response = _client(_config("--allow-credentials")).options("/health", headers={
        "Origin": "http://x.example", "Access-Control-Request-Method": "POST"})
    assert response.headers["access-control-allow-origin"] == "http://x.example"
    assert response.headers["access-control-allow-credentials"] == "true"


def test_disable_fastapi_docs():
    on, off = _client(_config()), _client(_config("--disable-fastapi-docs"))
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert on.get(path).status_code == 200, path
        assert off.get(path).status_code == 404, path
    assert off.get("/health").status_code == 200


def test_root_path_reaches_uvicorn_and_the_schema():
    options = uvicorn_options(_config("--root-path", "/llm"))
    assert options == {"root_path": "/llm"}
    client = _client(_config("--root-path", "/llm"), root_path=options["root_path"])
    assert client.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    assert uvicorn_options(_config()) == {}


def test_request_id_header():
    client = _client(_config("--enable-request-id-headers"))
    given = client.get("/health", headers={"X-Request-Id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = client.get("/version").headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0  # a uuid4 in hex
    assert client.get("/version").headers["x-request-id"] != made
    assert "x-request-id" not in _client(_config()).get("/health").headers


def test_ssl_files_checked_and_passed(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    config = _config("--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                     "--ssl-ca-certs", str(cert))
    check_ssl_files(config)  # loads
    assert uvicorn_options(config) == {"ssl_keyfile": str(key), "ssl_certfile": str(cert),
                                       "ssl_ca_certs": str(cert)}
    with pytest.raises(ValueError, match="--ssl-certfile .*cannot load them"):
        check_ssl_files(_config("--ssl-keyfile", str(cert), "--ssl-certfile", str(cert)))
    with pytest.raises(ValueError, match="--ssl-ca-certs .*cannot load it"):
        check_ssl_files(_config("--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                                "--ssl-ca-certs", str(tmp_path / "missing.pem")))


# ---- --default-chat-template-kwargs and --chat-template-content-format in render_chat ----
GREETING = ("{% if greeting is defined %}[{{ greeting }}]{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PARTS = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                      {"type": "text", "text": "b"}]}]


def test_default_template_kwargs_under_the_request(tiny_tokenizer):
    from kvflow.chat.template import render_chat

    hi = [{"role": "user", "content": "hi"}]
    defaults = {"greeting": "hello", "enable_thinking": False}  # the template reads no 2nd
    out = render_chat(tiny_tokenizer, hi, chat_template=GREETING, default_kwargs=defaults)
    assert out == "[hello]<user>hi\n<assistant>"
    out = render_chat(tiny_tokenizer, hi, chat_template=GREETING, default_kwargs=defaults,
                      template_kwargs={"greeting": "yo"})
    assert out == "[yo]<user>hi\n<assistant>"
    assert render_chat(tiny_tokenizer, hi, chat_template=GREETING) == "<user>hi\n<assistant>"


@pytest.mark.parametrize("content_format,rendered", [
    ("string", "a\nb"),
    ("openai", "[{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]"),
    ("auto", "a\nb"),  # this template does not loop over content: one string
])
def test_content_format(tiny_tokenizer, content_format, rendered):
    from kvflow.chat.template import render_chat

    out = render_chat(tiny_tokenizer, PARTS, chat_template=GREETING,
                      content_format=content_format)
    assert out == f"<user>{rendered}\n<assistant>"


def test_vllm_flags_in_a_config_file(tmp_path):
    """A vLLM YAML config's keys: lists for the CORS lists, a mapping for the JSON flag."""
    from kvflow.entrypoints.config_file import expand_config_file

    path = tmp_path / "serve.yaml"
    path.write_text("enable-auto-tool-choice: true\nallowed-origins: [http://a.example]\n"
                    "default_chat_template_kwargs: {enable_thinking: false}\n"
                    "root-path: /llm\nenable-log-requests: true\nmax-log-len: 7\n")
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["serve", "--config", str(path)]))
    config = ServerConfig.from_cli_args(args, env={})
    assert config.enable_auto_tool_choice is True
    assert config.allowed_origins == ("http://a.example",)
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert (config.root_path, config.log_requests, config.max_log_len) == ("/llm", True, 7)


def test_a_list_flag_does_not_take_the_model_argument():
    """vLLM's list flags take one word each (a JSON list), so the positional model after one
    is still the model."""
    args = build_parser().parse_args(["serve", "--allowed-origins", '["*"]', "some/model"])
    assert args.model_tag == "some/model"
    assert ServerConfig.from_cli_args(args, env={}).allowed_origins == ("*",)


def test_root_path_keeps_open_routes_open_and_bodyless_posts_bodyless():
    """Behind ``--root-path /llm``, uvicorn hands the app ``path`` = root path + the path the
    proxy forwarded (TestClient's scope for ``/llm/...`` with ``root_path="/llm"`` is that
    one). The API-key check and the JSON-body rule judge the route's path, as vLLM strips the
    root path: /health, /metrics ... stay open without the key (it had been asked for: a
    load balancer's probe got 401), POST /wake_up takes no body (it had been a 400 asking for
    JSON), and every other route still needs the key."""
    from kvflow.entrypoints.api_server import build_app

    woken = []

    async def wake_up(tags):
        woken.append(tags)

    config = ServerConfig.from_cli_args(build_parser().parse_args(
        ["serve", "--api-key", "k", "--root-path", "/llm"]), env={"KVFLOW_SERVER_DEV_MODE": "1"})
    engine = SimpleNamespace(config=EngineConfig(), is_healthy=True, wake_up=wake_up)
    client = TestClient(build_app(engine, config, "m"), root_path="/llm")
    assert client.get("/llm/health").status_code == 200
    assert client.get("/llm/version").json() == {"version": __version__}
    assert client.get("/llm/ping").status_code == 200
    for method, path in (("GET", "/llm/v1/models"), ("POST", "/llm/wake_up"),
                         ("GET", "/llm/openapi.json"), ("GET", "/llm/llm/health")):
        refused = client.request(method, path)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key"
    woke = client.post("/llm/wake_up", headers={"Authorization": "Bearer k"})
    assert (woke.status_code, woken) == (200, [None])


@pytest.mark.parametrize("argv", [["--api-key", "key-a", "key-b"], ["--config", "CONFIG"]])
def test_several_api_keys_each_open_the_server(argv, tmp_path):
    """vLLM's ``--api-key`` takes a list (nargs "+"; a config file's ``api-key: [..]``), any of
    them accepted; kvflow took one key, so vLLM's ``--api-key a b`` was refused at start
    ("unrecognized arguments: b"). Each key opens the routes, a third key or none does not
    (401, invalid_api_key), and /health stays open."""
    from kvflow.entrypoints.api_server import build_app
    from kvflow.entrypoints.config_file import expand_config_file

    if "CONFIG" in argv:
        config_file = tmp_path / "serve.yaml"
        config_file.write_text("api-key: [key-a, key-b]\n")
        argv = ["--config", str(config_file)]
    parser = build_parser()
    config = ServerConfig.from_cli_args(
        parser.parse_args(expand_config_file(parser, ["serve", *argv])), env={})
    assert config.api_key == ("key-a", "key-b")
    engine = SimpleNamespace(config=EngineConfig(), is_healthy=True)
    client = TestClient(build_app(engine, config, "m"))
    for key in ("key-a", "key-b"):
        opened = client.get("/openapi.json", headers={"Authorization": f"Bearer {key}"})
        assert opened.status_code == 200, key
    for header in ("Bearer key-c", "Bearer key-a key-b", "Bearer key-akey-b", ""):
        refused = client.get("/openapi.json", headers={"Authorization": header})
        assert refused.status_code == 401, header
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/health").status_code == 200


def test_one_api_key_is_a_tuple_of_one():
    """A config file's (or a caller's) single key string is one key, as before."""
    assert ServerConfig(api_key="k").api_key == ("k",)
    for bad in ((), ("k", " ")):
        with pytest.raises(ValueError, match="api_key"):
            ServerConfig(api_key=bad)
