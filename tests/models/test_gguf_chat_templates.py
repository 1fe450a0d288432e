"""Named chat templates: a GGUF's ``tokenizer.chat_template.<name>`` (gguf-py writes a
tokenizer_config.json list of templates so: the ``default`` one as ``tokenizer.chat_template``,
the others by name, listed in ``tokenizer.chat_templates``; Hermes models' ``tool_use``) load as
the dict transformers loads such a list into, and a conversation renders with the template
transformers' ``get_chat_template`` picks (``tool_use`` when tools are given, else
``default``), for a GGUF and an HF folder alike. Oracle: transformers' ``apply_chat_template`` on
a tokenizer holding the same dict. Before: the GGUF's named templates were dropped (tools
rendered with the default template, which ignores them, or were refused), and a tokenizer
holding a dict of templates failed every chat (``TypeError: unhashable type: 'dict'``)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.chat.messages import ChatTemplateError
from kvflow.chat.template import render_chat
from kvflow.models.gguf_tokenizer import load_gguf_tokenizer
from tests.models.test_gguf_add_bos import MERGES, VOCAB

gguf = pytest.importorskip("gguf")

DEFAULT = "D:{% for m in messages %}{{ m['content'] }};{% endfor %}"
TOOL_USE = ("T:{% for t in tools %}{{ t['function']['name'] }},{% endfor %}"
            "{% for m in messages %}{{ m['content'] }};{% endfor %}")
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _write(path, templates) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(VOCAB)
    w.add_token_types([3, 3, 3] + [1] * (len(VOCAB) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_chat_template(templates)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _oracle(templates: dict[str, str]):
    """transformers' own choice among named templates."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE({"a": 0}, [])))
    tok.chat_template = templates
    return tok


def test_gguf_named_templates_render_as_transformers_picks(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = _write(tmp_path / "v.gguf", [{"name": "default", "template": DEFAULT},
                                        {"name": "tool_use", "template": TOOL_USE}])
    oracle = _oracle({"default": DEFAULT, "tool_use": TOOL_USE})
    for attempt in ("converted", "from the cache"):
        tokenizer = load_gguf_tokenizer(path)
        assert tokenizer.chat_template == {"default": DEFAULT, "tool_use": TOOL_USE}, attempt
        for tools in (None, TOOLS):
            expected = oracle.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
            assert render_chat(tokenizer, MESSAGES, tools=tools) == expected, (attempt, tools)
        assert render_chat(tokenizer, MESSAGES, tools=TOOLS) == "T:get_weather,hi;"


def test_gguf_single_template_stays_a_string(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = load_gguf_tokenizer(_write(tmp_path / "v.gguf", DEFAULT))
    assert tokenizer.chat_template == DEFAULT
    assert render_chat(tokenizer, MESSAGES) == "D:hi;"


def test_hf_folder_with_named_templates(tiny_chat_model, tmp_path):
    """An HF tokenizer saved with a dict of templates (transformers writes the extra ones to
    ``additional_chat_templates/``): chat renders with the one transformers picks."""
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    tokenizer.chat_template = {"default": DEFAULT, "tool_use": TOOL_USE}
    tokenizer.save_pretrained(folder)
    loaded = AutoTokenizer.from_pretrained(folder)
    assert isinstance(loaded.chat_template, dict)
    assert render_chat(loaded, MESSAGES) == "D:hi;"
    assert render_chat(loaded, MESSAGES, tools=TOOLS) == "T:get_weather,hi;"


def test_named_templates_without_a_default_are_refused():
    tokenizer = _oracle({"tool_use": TOOL_USE})
    assert render_chat(tokenizer, MESSAGES, tools=TOOLS) == "T:get_weather,hi;"
    with pytest.raises(ChatTemplateError, match=r"named chat templates \['tool_use'\] and no "
                                                r"'default' one"):
        render_chat(tokenizer, MESSAGES)
