"""``--chat-template`` (``kvflow serve`` and ``kvflow generate``; kvflow/chat_template_source.py):
a file or the template itself, read and compiled before the model loads; a server renders
every conversation with it unless a request (trusted) sends its own; a model template that
does not compile is a warning at start-up. Oracles: transformers' ``apply_chat_template`` with
the same template, the tokenizer's own encoding, and hand-written expected messages."""

from __future__ import annotations

import copy

import pytest

from kvflow.chat_template import ChatTemplateError, render_chat
from kvflow.chat_template_source import (
    load_chat_template,
    template_syntax_error,
)

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
