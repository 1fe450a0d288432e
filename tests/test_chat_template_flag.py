"""``--chat-template`` (``kvflow serve`` and ``kvflow generate``; kvflow/chat_template_source.py):
a file or the template itself, read and compiled before the model loads; a server renders
every conversation with it unless a request (trusted) sends its own; a model template that
does not compile is a warning at start-up. Oracles: transformers' ``apply_chat_template`` with
the same template, the tokenizer's own encoding, and hand-written expected messages."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest

from kvflow import chat_template_source
from kvflow.chat.template import ChatTemplateError, render_chat
from kvflow.chat_template_source import (
    load_chat_template,
    model_template_warning,
    template_syntax_error,
    warn_if_model_template_broken,
)
from kvflow.config import ServerConfig

MODEL_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
FLAG_TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
REQUEST_TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
# line 3 breaks: a `}` where `}}` closes the expression
BROKEN = "{% for m in messages %}\n{{ m['role'] }}\n{{ m['content'] }\n{% endfor %}"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def _file(tmp_path, data: bytes | str, name: str = "chat.jinja") -> str:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


# ---- reading the flag's value ------------------------------------------------------------------
def test_a_file_is_read_and_an_inline_template_taken_as_it_is(tmp_path):
    """A path that exists is read (a UTF-8 byte-order mark dropped: an editor's, not the
    template's); a value naming no file but holding Jinja markup is the template."""
    assert load_chat_template(_file(tmp_path, FLAG_TEMPLATE)) == FLAG_TEMPLATE
    assert load_chat_template(_file(tmp_path, b"\xef\xbb\xbf" + FLAG_TEMPLATE.encode(),
                                    "bom.jinja")) == FLAG_TEMPLATE
    assert load_chat_template(FLAG_TEMPLATE) == FLAG_TEMPLATE
    comment_only = "{# nothing but a comment #}hello"
    assert load_chat_template(comment_only) == comment_only


def test_a_file_wins_over_markup_in_its_name(tmp_path):
    """vLLM's order: a value that names an existing file is that file, even with Jinja
    markup in its name."""
    path = _file(tmp_path, FLAG_TEMPLATE, "{{odd}}.jinja")
    assert load_chat_template(path) == FLAG_TEMPLATE


@pytest.mark.parametrize("case, expected", [
    ("missing", ("--chat-template {path}: no such file (a template given inline, not as a "
                 "file, must hold Jinja markup: {%, {{ or {#)")),
    ("folder", "--chat-template {path}: cannot read it (Is a directory)"),
    ("not_utf8", "--chat-template {path}: not UTF-8 text (byte 0xe9 at offset 4)"),
    ("empty", "--chat-template {path}: the file is empty"),
    ("blank", "--chat-template {path}: the file is empty (blank)"),
    ("syntax", "--chat-template {path}: not a valid Jinja template (line 3: unexpected '}')"),
    ("huge", ("--chat-template {path}: larger than 1 MiB, not a chat template (those are a "
              "few KiB)")),
    ("device", ("--chat-template {path}: larger than 1 MiB, not a chat template (those are a "
                "few KiB)")),
    ("inline_syntax", ("--chat-template <inline template>: not a valid Jinja template "
                       "(line 3: unexpected '}')")),
])
def test_unusable_values_are_refused_naming_flag_and_file(tmp_path, case, expected):
    path = {"missing": lambda: str(tmp_path / "no-such.jinja"),
            "folder": lambda: str(tmp_path),
            "not_utf8": lambda: _file(tmp_path, b"f\xc3\xa9 \xe9t\xe9"),
            "empty": lambda: _file(tmp_path, b""),
            "blank": lambda: _file(tmp_path, " \n\t"),
            "syntax": lambda: _file(tmp_path, BROKEN),
            "huge": lambda: _file(tmp_path, "{{ x }}" + " " * (1 << 20)),  # 1 MiB + 7 bytes
            "device": lambda: "/dev/zero",  # endless: read up to the limit only
            "inline_syntax": lambda: BROKEN}[case]()
    with pytest.raises(ValueError) as info:
        load_chat_template(path)
    assert str(info.value) == expected.replace("{path}", path)


def test_the_check_compiles_as_transformers_renders(tiny_tokenizer):
    """transformers' own template extensions (``{% generation %}``, ``{% break %}``) pass the
    check, and transformers renders the template (a plain Jinja environment refuses both
    tags); a template with an unknown tag fails both."""
    good = ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
            "{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}")
    bad = "{% for m in messages %}{% shout %}{{ m['content'] }}{% endfor %}"
    assert template_syntax_error(good) is None
    assert tiny_tokenizer.apply_chat_template(MESSAGES, chat_template=good,
                                              tokenize=False) == "be brief"
    assert template_syntax_error(bad).message.startswith("Encountered unknown tag 'shout'")
    with pytest.raises(Exception, match="unknown tag 'shout'"):
        tiny_tokenizer.apply_chat_template(MESSAGES, chat_template=bad, tokenize=False)


# ---- rendering with a default template ---------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)  # the session's tokenizer stays without a template
    tok.chat_template = MODEL_TEMPLATE
    return tok


def _hf(tokenizer, template: str, messages=MESSAGES) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)


def test_default_template_replaces_the_models_and_the_callers_wins(tok, tiny_tokenizer):
    assert render_chat(tok, MESSAGES, default_template=FLAG_TEMPLATE) == \
        _hf(tok, FLAG_TEMPLATE) != _hf(tok, MODEL_TEMPLATE)
    assert render_chat(tok, MESSAGES, chat_template=REQUEST_TEMPLATE,
                       default_template=FLAG_TEMPLATE) == "be brief|hi|"
    # a model without a template: the default is enough
    assert not tiny_tokenizer.chat_template
    assert render_chat(tiny_tokenizer, MESSAGES, default_template=FLAG_TEMPLATE) == \
        _hf(tok, FLAG_TEMPLATE)


def test_default_template_errors_are_the_conversations(tok):
    """A default template the conversation fails in blames ``messages`` (the request sent no
    chat_template); one that does not compile (start-up checks it) names --chat-template."""
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}" \
        "{% endif %}"
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, MESSAGES, default_template=strict)
    assert info.value.param == "messages" and str(info.value).endswith("no system")
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, MESSAGES, default_template=BROKEN)
    assert (info.value.param, str(info.value)) == (
        "messages", ("the server's --chat-template is not a valid Jinja template (line 3: "
                     "unexpected '}')"))


# ---- the server --------------------------------------------------------------------------------
def _engine(tokenizer):
    """What the chat handler and /tokenize use of an AsyncLLM (no model)."""
    from kvflow.inputs.processor import InputProcessor

    return SimpleNamespace(tokenizer=tokenizer, processor=InputProcessor(tokenizer, 256, 320, 0),
                           max_model_len=256, vocab_size=320, task="generate",
                           config=SimpleNamespace(lora_config=SimpleNamespace(enable_lora=False)))


def _render(chat, messages=MESSAGES, chat_template=None):
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=messages, chat_template=chat_template)
    return asyncio.run(chat.render(req.messages, ChatOptions.of(req)))


@pytest.mark.parametrize("inline", [False, True], ids=["file", "inline"])
def test_server_renders_every_conversation_with_the_flag(tmp_path, tok, inline):
    """The flag's template, not the model's, renders chat prompts (text and token ids as
    transformers renders and the tokenizer encodes them)."""
    from kvflow.entrypoints.serving_chat import OpenAIServingChat

    value = FLAG_TEMPLATE if inline else _file(tmp_path, FLAG_TEMPLATE)
    chat = OpenAIServingChat(_engine(tok), ServerConfig(chat_template=value), "m")
    text, ids = _render(chat)
    assert text == _hf(tok, FLAG_TEMPLATE) != _hf(tok, MODEL_TEMPLATE)
    assert ids == tok.encode(text, add_special_tokens=False)


def test_a_trusted_request_template_wins_over_the_flag(tmp_path, tok):
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.serving_chat import OpenAIServingChat

    path = _file(tmp_path, FLAG_TEMPLATE)
    trusted = OpenAIServingChat(_engine(tok), ServerConfig(
        chat_template=path, trust_request_chat_template=True), "m")
    assert _render(trusted, chat_template=REQUEST_TEMPLATE)[0] == "be brief|hi|"
    assert _render(trusted)[0] == _hf(tok, FLAG_TEMPLATE)  # the flag's for the others
    untrusted = OpenAIServingChat(_engine(tok), ServerConfig(chat_template=path), "m")
    with pytest.raises(OpenAIError) as info:
        _render(untrusted, chat_template=REQUEST_TEMPLATE)
    assert (info.value.status, info.value.param, info.value.code) == \
        (400, "chat_template", "unsupported_parameter")


def test_the_flag_serves_chat_for_a_model_without_a_template(tiny_tokenizer):
    """A model without a chat template: a 400 (code no_chat_template) without the flag, the
    flag's rendering with it."""
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.serving_chat import OpenAIServingChat

    assert not tiny_tokenizer.chat_template
    with pytest.raises(OpenAIError) as info:
        _render(OpenAIServingChat(_engine(tiny_tokenizer), ServerConfig(), "m"))
    assert (info.value.status, info.value.code) == (400, "no_chat_template")
    chat = OpenAIServingChat(_engine(tiny_tokenizer),
                             ServerConfig(chat_template=FLAG_TEMPLATE), "m")
    assert _render(chat)[0] == _hf(tiny_tokenizer, FLAG_TEMPLATE)


def test_tokenize_over_http_counts_the_flags_prompt(tmp_path, tok):
    """The app ``build_app`` makes (ASGI, no model): /tokenize's messages render with the
    flag's template; the ids are the tokenizer's for transformers' rendering."""
    import httpx

    from kvflow.entrypoints.api_server import build_app

    app = build_app(_engine(tok), ServerConfig(chat_template=_file(tmp_path, FLAG_TEMPLATE)),
                    "m")

    async def post():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/tokenize", json={"model": "m", "messages": MESSAGES})

    resp = asyncio.run(post())
    expected = tok.encode(_hf(tok, FLAG_TEMPLATE), add_special_tokens=False)
    assert resp.status_code == 200, resp.text
    assert (resp.json()["tokens"], resp.json()["count"]) == (expected, len(expected))


BROKEN_WARNING = (
    "the model's chat template is not a valid Jinja template (line 3: unexpected '}'), so no "
    "conversation can be rendered; fix the model's chat_template.jinja (or the chat_template "
    "in its tokenizer_config.json), or serve another with --chat-template; chat requests get "
    "a 400 until then, completions are served")


def test_the_models_broken_template_is_a_warning(tok, caplog):
    """A model template that does not compile: one warning naming the Jinja line and the way
    out (hand-written); none for a template that compiles, nor without a tokenizer."""
    broken = copy.deepcopy(tok)
    broken.chat_template = BROKEN
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        warn_if_model_template_broken(tok)
        warn_if_model_template_broken(None)
        assert caplog.records == []
        warn_if_model_template_broken(broken)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == \
        [(logging.WARNING, BROKEN_WARNING)]


@pytest.mark.parametrize("flag", [False, True], ids=["model_template", "flag"])
def test_serve_warns_of_the_models_template_before_the_model_loads(tok, tmp_path, caplog,
                                                                   monkeypatch, flag):
    """``kvflow serve`` warned of a broken model template when it built the chat handler,
    after the weights had loaded (minutes for a large model); now the warning comes once, as
    soon as the tokenizer is loaded (AsyncLLM's ``on_tokenizer``), while the model loads
    (oracle: the log at the moment the stand-in engine finishes loading). With
    --chat-template, which replaces the model's, none."""
    from kvflow.entrypoints import api_server
    from kvflow.entrypoints.cli import main

    broken = copy.deepcopy(tok)
    broken.chat_template = BROKEN
    at_load_end = []

    def load_model(*args, on_tokenizer=None, **kwargs):  # tokenizer first, then the model
        if on_tokenizer is not None:
            on_tokenizer(broken)
        at_load_end.append([r.getMessage() for r in caplog.records
                            if r.levelno == logging.WARNING])
        return SimpleNamespace(**vars(_engine(broken)), close=lambda: None)

    monkeypatch.setattr(api_server, "AsyncLLM", load_model)
    monkeypatch.setattr(api_server, "_StartingServer", lambda config, app: SimpleNamespace(
        run=lambda: None, end_as_signalled=lambda: None))
    flags = ["--chat-template", _file(tmp_path, FLAG_TEMPLATE)] if flag else []
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        assert main(["serve", "SmolLM2-135M-Instruct", "--port", "0", *flags]) == 0
    expected = [] if flag else [BROKEN_WARNING]
    assert at_load_end == [expected]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == expected


def test_async_llm_hands_over_the_tokenizer_before_waiting_for_the_model(monkeypatch):
    """AsyncLLM calls ``on_tokenizer`` with the tokenizer it loaded before it waits for the
    core processes to load the model (here: no process started; the wait ends the test)."""
    from kvflow.config import EngineConfig
    from kvflow.engine import async_llm
    from kvflow.models.loader import load_tokenizer
    from kvflow.models.model_resolver import resolve_model

    events = []

    class Loading(Exception):
        pass

    def wait_ready(self, timeout):
        events.append("wait for the model")
        raise Loading

    monkeypatch.setattr(async_llm.ReplicaSet, "start", lambda self, gated=False: None)
    monkeypatch.setattr(async_llm.AsyncLLM, "_wait_ready", wait_ready)
    config = EngineConfig.from_kwargs(model="SmolLM2-135M-Instruct", device="cpu")
    with pytest.raises(Loading):
        async_llm.AsyncLLM(config, on_tokenizer=lambda t: events.append(t.chat_template))
    expected = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"), None).chat_template
    assert events == [expected, "wait for the model"] and "{%" in expected


def test_named_templates_are_each_checked(tok):
    """A tokenizer holding named templates (a dict, as transformers loads several): each is
    compiled; the broken one is named."""
    named = SimpleNamespace(chat_template={"default": MODEL_TEMPLATE, "tool_use": BROKEN})
    assert model_template_warning(named).endswith(
        "(the template named 'tool_use'), or serve another with --chat-template; chat "
        "requests get a 400 until then, completions are served")
    assert model_template_warning(SimpleNamespace(chat_template={"default": MODEL_TEMPLATE})) \
        is None
    assert model_template_warning(None) is None


@pytest.mark.parametrize("how", ["flag", "config_file"])
def test_serve_refuses_a_bad_template_before_the_model_loads(tmp_path, monkeypatch, capsys,
                                                             how):
    """``kvflow serve --chat-template`` (or the --config file's chat_template key) with a
    template that does not compile: one line naming the flag, the file and the Jinja line,
    exit 2, and no engine started."""
    from kvflow.engine import async_llm
    from kvflow.entrypoints.cli import main

    def no_engine(*args, **kw):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_engine)
    path = _file(tmp_path, BROKEN)
    if how == "flag":
        flags = ["--chat-template", path]
    else:
        config = tmp_path / "serve.yaml"
        config.write_text(f"chat_template: {path}\n")
        flags = ["--config", str(config)]
    rc = main(["serve", "SmolLM2-135M-Instruct", "--port", "0", *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    where = "" if how == "flag" else f"{config}: key 'chat_template': "  # the file's key named
    assert rc == 2 and err == [(f"kvflow: error: {where}--chat-template {path}: not a valid "
                                "Jinja template (line 3: unexpected '}')")], err


def test_serve_reads_the_template_once_and_serves_what_it_checked(tmp_path, tok,
                                                                  monkeypatch):
    """``kvflow serve --chat-template FILE`` read the file before the model loaded (the check)
    and again when it built the app: two reads, and a file edited while the model loaded (here
    made broken) was served unchecked, or failed the start after the load. Now one read, whose
    text is served: the app's chat handler renders with the template as it was at start-up
    (oracle: transformers' rendering with that template)."""
    from kvflow.entrypoints import api_server
    from kvflow.entrypoints.cli import main

    path = _file(tmp_path, FLAG_TEMPLATE)
    reads, apps = [], []
    read = chat_template_source._read_template_file
    monkeypatch.setattr(chat_template_source, "_read_template_file",
                        lambda p: reads.append(p) or read(p))

    def load_model(*args, **kwargs):  # the model loads; meanwhile the file is edited
        _file(tmp_path, BROKEN)
        return SimpleNamespace(**vars(_engine(tok)), close=lambda: None)

    def served(app, *args, **kwargs):  # the app is built: look at it instead of serving it
        apps.append(app)
        return SimpleNamespace(run=lambda: None, end_as_signalled=lambda: None)

    monkeypatch.setattr(api_server, "AsyncLLM", load_model)
    monkeypatch.setattr(api_server, "_StartingServer",
                        lambda config, app: served(app))
    assert main(["serve", "SmolLM2-135M-Instruct", "--port", "0", "--chat-template", path]) == 0
    assert reads == [path]
    assert _render(apps[0].state.chat)[0] == _hf(tok, FLAG_TEMPLATE)
    with pytest.raises(ValueError, match="without config.chat_template"):  # text of no flag
        api_server.OpenAIServingChat(_engine(tok), ServerConfig(), "m",
                                     chat_template=FLAG_TEMPLATE)


def test_an_empty_flag_is_refused():
    with pytest.raises(ValueError, match="chat_template='' is invalid: it must not be empty"):
        ServerConfig(chat_template="")


@pytest.mark.parametrize("value", [None, 5, ""])
def test_load_chat_template_refuses_what_is_no_path_or_text(value):
    """From Python, a value that is no string (or an empty one) is a ValueError saying what
    the flag takes (was a TypeError from os.stat, or 'no such file' for '')."""
    with pytest.raises(ValueError) as info:
        load_chat_template(value)
    assert str(info.value) == ("--chat-template must be a file's path or a template's text, "
                               f"got {value!r}")


# ---- kvflow generate ---------------------------------------------------------------------------
@pytest.mark.parametrize("flags, needle", [
    (["--chat-template", FLAG_TEMPLATE], "--chat-template needs --chat"),
    (["--chat", "--chat-template", BROKEN],
     "--chat-template <inline template>: not a valid Jinja template (line 3"),
])
def test_generate_refuses_the_flag_before_the_model_loads(tiny_llama, monkeypatch, capsys,
                                                          flags, needle):
    from kvflow.entrypoints.cli import main
    from kvflow.offline.llm import LLM

    def no_model(*args, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LLM, "from_engine_config", no_model)
    rc = main(["generate", "--model", tiny_llama.path, "--prompt", "hi", *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"kvflow: error: {needle}"), err


def test_generate_chats_with_the_flags_template(tiny_llama, tmp_path, capsys):
    """The tiny model has no chat template (``--chat`` alone is refused); with the flag, the
    greedy completion is the one of transformers' rendering of that template."""
    from transformers import AutoTokenizer

    from kvflow import LLM, SamplingParams
    from kvflow.entrypoints.cli import main

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    assert not tokenizer.chat_template
    messages = [{"role": "user", "content": "the lazy fox"}]
    ids = tokenizer.encode(_hf(tokenizer, FLAG_TEMPLATE, messages), add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=5)
    expected = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64).generate(
        [{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    argv = ["generate", "--model", tiny_llama.path, "--dtype", "float32", "--num-kv-blocks",
            "64", "--prompt", "the lazy fox", "--max-tokens", "5", "--temperature", "0",
            "--chat", "--verbose"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "this model has no chat template" in err and "--chat-template FILE" in err
    assert main([*argv, "--chat-template", _file(tmp_path, FLAG_TEMPLATE)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == expected.text and f"tokens={len(expected.token_ids)}" in out[1]


# ---- a pipe named as the file ------------------------------------------------------------------
def test_a_pipe_is_read_to_its_end(tmp_path):
    """bash's ``--chat-template <(cat t.jinja)`` and a FIFO with a writer: read until the
    writer closes it, in chunks (the writer sends the template in two parts)."""
    fifo = str(tmp_path / "t.fifo")
    os.mkfifo(fifo)

    def write():
        with open(fifo, "wb") as f:  # blocks until the reader opens the FIFO
            f.write(FLAG_TEMPLATE[:5].encode())
            f.flush()
            time.sleep(0.1)
            f.write(FLAG_TEMPLATE[5:].encode())

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert load_chat_template(fifo) == FLAG_TEMPLATE
    finally:
        writer.join(5)


def test_a_pipe_nothing_writes_to_is_refused_not_waited_on(tmp_path, monkeypatch):
    """A FIFO without a writer used to block start-up for ever in ``open``; now it is opened
    without blocking and refused once PIPE_WAIT_S passes without data."""
    monkeypatch.setattr(chat_template_source, "PIPE_WAIT_S", 0.2)
    fifo = str(tmp_path / "idle.fifo")
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        load_chat_template(fifo)
    assert time.monotonic() - start < 5
    assert str(info.value) == (f"--chat-template {fifo}: a pipe that sent no template within "
                               "0.2 s (nothing writing to it?)")


def test_a_pipe_whose_writer_never_closes_it_is_refused_saying_so(tmp_path, monkeypatch):
    """``(echo '{{ messages }}'; sleep 40) > fifo``: the template came but the pipe stayed
    open; the message said nothing was written (newcomer check, session 29)."""
    monkeypatch.setattr(chat_template_source, "PIPE_WAIT_S", 0.3)
    fifo = str(tmp_path / "open.fifo")
    os.mkfifo(fifo)
    release = threading.Event()

    def write():
        with open(fifo, "wb") as f:
            f.write(b"{{ messages }}\n")
            f.flush()
            release.wait(5)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        with pytest.raises(ValueError) as info:
            load_chat_template(fifo)
    finally:
        release.set()
        writer.join(5)
    assert str(info.value) == (f"--chat-template {fifo}: a pipe that sent 15 bytes but was not "
                               "closed within 0.3 s (is its writer still running?)")
