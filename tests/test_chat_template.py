"""Conversation rendering (kvflow/chat/template.py; its message checks: kvflow/chat/messages.py),
the offline ``LLM.chat`` options and ``LLM.generate(priority=...)``. Oracles: the HF tokenizer's
own ``apply_chat_template`` on hand-normalized messages, hand-written templates, and the
scheduler's documented order."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

from kvflow import LLM, SamplingParams
from kvflow.chat.messages import normalize_conversation
from kvflow.chat.template import ChatTemplateError, NoChatTemplateError, render_chat

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)  # the session's tokenizer stays without a template
    tok.chat_template = TEMPLATE
    return tok


def test_null_parts_and_tool_arguments_normalized():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]
    out = normalize_conversation(messages)
    assert [m["content"] for m in out] == ["a\nb", "", "no"]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[1]["content"] is None  # the caller's messages are not changed


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"content": "x"}], "messages.0"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "x"}], "messages.1.role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages.0.content.0"),
    ([{"role": "user", "content": 5}], "messages.0.content"),
    ([{"role": "user", "content": "a\ud800"}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
    ([{"role": "assistant", "content": [{"type": "refusal", "refusal": 3}]}],
     "messages.0.content.0.refusal"),
])
def test_bad_messages_name_the_field(tok, messages, param):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, messages)
    assert info.value.param == param


def test_options_honoured(tok):
    hi = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, hi) == "<user>hi\n<assistant>"
    assert render_chat(tok, hi, add_generation_prompt=False) == "<user>hi\n"
    partial = [*hi, {"role": "assistant", "content": "the"}]
    assert render_chat(tok, partial, add_generation_prompt=False,
                       continue_final_message=True) == "<user>hi\n<assistant>the"
    assert render_chat(tok, hi, chat_template="{{ x }}!", template_kwargs={"x": 3}) == "3!"
    # read only where defined, or inside a macro or loop: still read
    for template, text in [("{% if think is defined and not think %}no{% endif %}!", "no!"),
                           ("{% macro m() %}{{ think }}{% endmacro %}{{ m() }}!", "False!"),
                           ("{% for m in messages %}{{ think }}{% endfor %}!", "False!")]:
        assert render_chat(tok, hi, chat_template=template,
                           template_kwargs={"think": False}) == text
    docs = [{"text": "d1"}]
    assert render_chat(tok, hi, chat_template="{{ documents[0].text }}", documents=docs) == "d1"


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template,want", [
    (TEMPLATE, "<system>be brief\n<user>Once upon"),
    (CHATML, "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nOnce upon"),
])
def test_continue_final_message_continues_a_message_of_any_role(tok, template, want):
    """A last message from the user (or the system) is left open too, as transformers'
    ``apply_chat_template(..., continue_final_message=True)`` and vLLM leave it (it was
    refused: "needs the last message to be an assistant message")."""
    for last in ({"role": "user", "content": "Once upon"},
                 {"role": "system", "content": "Once upon"}):
        messages = [{"role": "system", "content": "be brief"}, last]
        got = render_chat(tok, messages, add_generation_prompt=False,
                          continue_final_message=True, chat_template=template)
        assert got == tok.apply_chat_template(messages, chat_template=template,
                                              tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True)
        assert got == want.replace("user", last["role"])


@pytest.mark.parametrize("kwargs,param", [
    ({"continue_final_message": True}, "continue_final_message"),  # + add_generation_prompt
    ({"documents": [{"text": "d"}]}, "documents"),  # the template never reads them
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template": "{{ 1 / 0 }}"}, "chat_template"),
    ({"chat_template": " "}, "chat_template"),  # empty: not "the model has no template"
    ({"chat_template": "chat.jinja"}, "chat_template"),  # a file's name, not its text
    ({"template_kwargs": [1]}, "chat_template_kwargs"),
    # a variable the template never reads was dropped unread (vLLM drops it too)
    ({"template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template": "{{ x }}", "template_kwargs": {"x": 1, "y": 2}},
     "chat_template_kwargs.y"),
    # not bools: "no" was read as true (a generation prompt added)
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"continue_final_message": 0}, "continue_final_message"),
])
def test_bad_options_rejected(tok, kwargs, param):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, [{"role": "user", "content": "hi"}], **kwargs)
    assert info.value.param == param


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
TOOL_TURNS = [{"role": "user", "content": "hi"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "c1", "content": "42"}]


def test_tool_calls_reach_the_template(tok):
    """An assistant's tool_calls reach a template that renders them, arguments as an object
    (transformers' tool-use convention), and a tool turn's tool_call_id too (hand-written
    expectation); a template that never mentions tool_calls is refused, naming the turn."""
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
                "{{ m.tool_call_id or '' }}={{ m.content }};{% endfor %}")
    assert render_chat(tok, TOOL_TURNS, chat_template=template,
                       add_generation_prompt=False) == '=hi;f{"x": 1}=;c1=42;'
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, TOOL_TURNS)
    assert info.value.param == "messages.1.tool_calls"


def test_no_chat_template_http_message(tiny_tokenizer):
    """Over HTTP the error speaks of request fields and endpoints, not of Python calls."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    plain = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    assert not plain.chat_template
    engine = SimpleNamespace(tokenizer=plain, processor=InputProcessor(plain, 64, 320, 0),
                             max_model_len=64)
    chat = OpenAIServingChat(engine, ServerConfig(), "m")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(OpenAIError) as info:
        asyncio.run(chat.render(req.messages, ChatOptions.of(req)))
    message = str(info.value)
    assert info.value.status == 400 and info.value.code == "no_chat_template"
    assert message == ("this model has no chat template: the server needs one (kvflow serve "
                       "--chat-template FILE), or use /v1/completions with a plain prompt")
    # a server that takes a request's template says so (was said by every server, also
    # those that refuse the field)
    trusting = OpenAIServingChat(engine, ServerConfig(trust_request_chat_template=True), "m")
    with pytest.raises(OpenAIError) as info:
        asyncio.run(trusting.render(req.messages, ChatOptions.of(req)))
    assert str(info.value) == ("this model has no chat template: send one in the request's "
                               "chat_template field, or use /v1/completions with a plain "
                               "prompt")
    stub = SimpleNamespace(engine=SimpleNamespace(processor=engine.processor, tokenizer=plain))
    stub._chat_prompts = lambda *args: LLM._chat_prompts(stub, *args)
    stub._render_chat = lambda *args, **kwargs: LLM._render_chat(stub, *args, **kwargs)
    with pytest.raises(NoChatTemplateError) as offline:
        LLM.chat(stub, [{"role": "user", "content": "hi"}])
    # offline, the error says how to give one (was "this model has no chat template" alone)
    assert str(offline.value) == ("this model has no chat template: give one, as "
                                  "chat_template (the Jinja text) or --chat-template FILE on "
                                  "the command line (kvflow generate --chat, serve, "
                                  "run-batch)")
    # an embedding server (/tokenize renders messages there) refuses /v1/completions: the
    # message named it; now the routes that server takes text on
    engine.task = "embed"
    with pytest.raises(OpenAIError) as info:
        asyncio.run(chat.render(req.messages, ChatOptions.of(req)))
    assert str(info.value) == ("this model has no chat template: the server needs one "
                               "(kvflow serve --chat-template FILE), or send the text as "
                               "/tokenize's prompt or /v1/embeddings' (/pooling's) input")


@pytest.fixture(scope="module")
def chat_llm(tiny_llama):
    llm = LLM(model=tiny_llama.path, num_kv_blocks=64, block_size=4, policy="priority",
              max_num_seqs=1)
    llm.engine.tokenizer.chat_template = TEMPLATE
    return llm


def test_llm_chat_null_content_and_continue(chat_llm):
    params = SamplingParams(temperature=0, max_tokens=2)
    out = chat_llm.chat([{"role": "user", "content": "a"}, {"role": "assistant",
                                                            "content": None}],
                        params, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt == "<user>a\n<assistant>"


def test_llm_chat_continues_a_final_user_message(chat_llm, tiny_llama):
    """Offline as on the server: the user's message is left open (``<user>a``, the
    template's text by hand; was a ValueError) and generation continues it."""
    from transformers import AutoTokenizer

    params = SamplingParams(temperature=0, max_tokens=2)
    out = chat_llm.chat([{"role": "user", "content": "a"}], params,
                        add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt == "<user>a"
    tok = AutoTokenizer.from_pretrained(tiny_llama.path)
    assert out[0].prompt_token_ids == tok.encode("<user>a", add_special_tokens=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_llm_chat_takes_vllms_positional_arguments(chat_llm):
    """``chat(messages, params, False)`` is vLLM's ``use_tqdm=False``: the third positional
    argument was ``add_generation_prompt``, so the prompt silently lost its
    ``<assistant>`` header; the fourth is vLLM's ``lora_request`` (None here), and the ones
    after it are keyword-only (vLLM's order there differs between versions)."""
    params = SamplingParams(temperature=0, max_tokens=2)
    hi = [{"role": "user", "content": "a"}]
    assert chat_llm.chat(hi, params, False)[0].prompt == "<user>a\n<assistant>"
    assert chat_llm.chat(hi, params, False, None)[0].prompt == "<user>a\n<assistant>"
    with pytest.raises(TypeError):
        chat_llm.chat(hi, params, False, None, "{{ messages }}")


def test_llm_chat_priority_and_content_format(chat_llm):
    """vLLM's ``priority`` (one per conversation: the lowest value runs first on the one
    running slot) and ``chat_template_content_format`` (``string``: the text itself;
    ``openai``: the list of parts, as the template prints it; ``auto``: a string for this
    template, which does not loop over the content) reach the engine and the template."""
    params = SamplingParams(temperature=0, max_tokens=3)
    convs = [[{"role": "user", "content": t}] for t in ("a b", "c d", "e f")]
    outs = chat_llm.chat(convs, params, use_tqdm=False, priority=[5, -5, 0])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 2, 0]
    with pytest.raises(ValueError, match="priority"):
        chat_llm.chat(convs, params, priority=[1, 2])
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    prompt = {fmt: chat_llm.chat(parts, params, chat_template_content_format=fmt)[0].prompt
              for fmt in ("auto", "string", "openai")}
    assert prompt["auto"] == prompt["string"] == "<user>a\n<assistant>"
    assert prompt["openai"] == "<user>[{'type': 'text', 'text': 'a'}]\n<assistant>"
    with pytest.raises(ValueError, match="chat_template_content_format='json' must be one "
                       "of auto, string, openai"):
        chat_llm.chat(parts, params, chat_template_content_format="json")


class _Bar:
    """A tqdm-like bar that counts its updates."""

    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


class _Bars:
    """A tqdm-like factory (vLLM's ``use_tqdm`` callable): records each bar it makes."""

    def __init__(self) -> None:
        self.made: list[dict] = []

    def __call__(self, **kwargs) -> _Bar:
        self.made.append({"kwargs": kwargs, "bar": _Bar()})
        return self.made[-1]["bar"]


def test_use_tqdm_callable_is_the_progress_bar(chat_llm):
    """vLLM's ``use_tqdm`` may be a tqdm factory: ``generate``, ``chat`` (and the pooling
    methods, through the same loop) make their bar with it, one update per finished
    prompt; it was taken as True and tqdm's own bar shown."""
    params = SamplingParams(temperature=0, max_tokens=2)
    bars = _Bars()
    chat_llm.generate(["a b", "c d", "e f"], params, use_tqdm=bars)
    chat_llm.chat([[{"role": "user", "content": "a"}]] * 2, params, bars)
    assert all(b["bar"].closed for b in bars.made)
    assert [(b["kwargs"], b["bar"].n) for b in bars.made] == [
        ({"total": 3, "desc": "Processed prompts"}, 3),
        ({"total": 2, "desc": "Processed prompts"}, 2)]
    chat_llm.generate(["a b"], params, use_tqdm=bars)  # one prompt: no bar, as with True
    assert len(bars.made) == 2


def test_generate_priority_orders_the_queue(chat_llm, assert_no_leaks):
    """One running slot: the prompts run one at a time, lowest priority value first."""
    params = SamplingParams(temperature=0, max_tokens=3)
    outs = chat_llm.generate(["a b", "c d", "e f"], params, use_tqdm=False, priority=[5, -5, 0])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 2, 0]
    assert_no_leaks(chat_llm)
    with pytest.raises(ValueError, match="priority"):
        chat_llm.generate(["a"], params, priority=[1, 2])


def test_priority_needs_the_priority_policy(tiny_llama):
    llm = LLM(model=tiny_llama.path, num_kv_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="policy"):
        llm.generate(["a"], SamplingParams(max_tokens=1), priority=[3])
    assert len(llm.generate(["a"], SamplingParams(max_tokens=1), priority=[0])) == 1


def test_other_message_keys_must_be_read(tok):
    """A message key beyond OpenAI's and vLLM's (a misspelled ``tool_call_idd``, another
    API's key) that the template does not read was passed on and silently ignored; now
    refused naming it (code ``unknown_parameter``), judged by rendering without it. A
    template that reads it gets it (hand-written expectation); OpenAI's own keys (``name``)
    and null values pass whether read or not."""
    turns = [{"role": "user", "content": "hi", "tool_call_idd": "c1"}]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, turns)
    assert (info.value.param, info.value.code) == ("messages.0.tool_call_idd",
                                                   "unknown_parameter")
    reads = "{% for m in messages %}{{ m.content }}/{{ m.tool_call_idd }}{% endfor %}"
    assert render_chat(tok, turns, chat_template=reads) == "hi/c1"
    needs = "{% for m in messages %}{{ m.content ~ m['weight'] }}{% endfor %}"  # reads it
    assert render_chat(tok, [{"role": "user", "content": "x", "weight": 2}],
                       chat_template=needs) == "x2"
    plain = render_chat(tok, [{"role": "user", "content": "hi"}])
    assert render_chat(tok, [{"role": "user", "content": "hi", "name": "bob",
                              "tool_call_idd": None}]) == plain
    many = [{"role": "user", "content": "hi", **{f"k{j}": j for j in range(9)}}]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, many, chat_template="{{ messages }}")  # reads them all
    assert info.value.param == "messages.0.k8"


@pytest.mark.parametrize("part,key", [({"type": "text", "text": "hi", "foo": 1}, "foo"),
                                      ({"type": "text", "text": "hi", "image_url": "u"},
                                       "image_url")])
def test_llm_chat_part_keys_are_checked(tok, part, key):
    """LLM.chat (no HTTP schema before it) refused nothing in a content part: an unknown key,
    or another type's payload, was dropped; now a ChatTemplateError naming it, as the
    server's 400 does. Null for another type's key passes (the server's parts carry them)."""
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, [{"role": "user", "content": [part]}])
    assert (info.value.param, info.value.code) == (f"messages.0.content.0.{key}",
                                                   "unknown_parameter")
    assert render_chat(tok, [{"role": "user", "content": [
        {"type": "text", "text": "hi", "image_url": None, "refusal": None}]}]) == \
        render_chat(tok, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("index, param", [(0, None), (1, "messages.1.tool_calls.0.index")])
def test_served_tool_call_index_checked_before_calls_become_text(tiny_tokenizer, index,
                                                                   param):
    """Over HTTP, a template that never reads tool_calls gets them as the tool parser's text
    (``chat.tools_text.with_calls_as_text``) before the conversation is normalized: a call's echoed
    ``index`` is still checked (a wrong one was accepted, HTTP 200) and a right one renders."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = TEMPLATE  # reads neither tools nor tool_calls
    engine = SimpleNamespace(tokenizer=plain, processor=InputProcessor(plain, 64, 320, 0),
                             max_model_len=64)
    chat = OpenAIServingChat(engine, ServerConfig(), "m")
    call = {"index": index, "id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"},
                                          {"role": "assistant", "tool_calls": [call]}])
    if param is None:
        text, _ = asyncio.run(chat.render(req.messages, ChatOptions.of(req)))
        assert text.startswith("<user>hi\n<assistant>") and '"f"' in text
        return
    with pytest.raises(OpenAIError) as info:
        asyncio.run(chat.render(req.messages, ChatOptions.of(req)))
    assert info.value.status == 400 and info.value.param == param


BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }\n{% endfor %}"


def test_template_syntax_error_blames_the_template(tiny_tokenizer):
    """A model template that does not compile was "the chat template cannot render these
    messages: TemplateSyntaxError: unexpected '}'" (param messages), as if another conversation
    could render; over HTTP it stays a 400 (no traceback), now naming the template's fault."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    broken = copy.deepcopy(tiny_tokenizer)
    broken.chat_template = BROKEN_TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(broken, messages)
    assert str(info.value) == (
        "the model's chat template is not a valid Jinja template (line 1: unexpected '}'), so "
        "no conversation can be rendered; fix the model's chat_template.jinja (or the "
        "chat_template in its tokenizer_config.json)")
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tiny_tokenizer, messages, chat_template=BROKEN_TEMPLATE)
    assert str(info.value) == "chat_template is not a valid Jinja template (line 1: unexpected '}')"
    assert info.value.param == "chat_template"

    engine = SimpleNamespace(tokenizer=broken, processor=InputProcessor(broken, 64, 320, 0),
                             max_model_len=64)
    chat = OpenAIServingChat(engine, ServerConfig(), "m")
    req = ChatCompletionRequest(messages=messages)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(chat.render(req.messages, ChatOptions.of(req)))
    assert info.value.status == 400
    assert str(info.value).startswith("the model's chat template is not a valid Jinja template")


@pytest.fixture(scope="module")
def served_chat(tok):
    """The server's chat handler (rendering only) on ``tok`` (TEMPLATE: reads neither tools
    nor tool_calls, so an assistant's calls become the tool parser's text)."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    engine = SimpleNamespace(tokenizer=tok, processor=InputProcessor(tok, 64, 320, 0),
                             max_model_len=4096)
    return OpenAIServingChat(engine, ServerConfig(), "m")


def _served_render(served_chat, messages: list[dict]) -> str:
    """The prompt text /v1/chat/completions renders for ``messages`` (an OpenAIError for a
    conversation it refuses)."""
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": messages})
    return asyncio.run(served_chat.render(req.messages, ChatOptions.of(req)))[0]


HI = {"role": "user", "content": "hi"}
CALLS_READ = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"  # reads tool_calls
              "{% for c in m.tool_calls or [] %}{{ c.function.name }}{% endfor %}{% endfor %}")
NO_CONTENT = [  # (conversation, the message sent without content)
    ([{"role": "user"}], 0),
    ([{"role": "system"}, HI], 0),
    ([{"role": "developer"}, HI], 0),
    ([HI, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1"}],
     2),
    ([HI, {"role": "assistant"}, HI], 1),  # an assistant without calls needs content too
]


@pytest.mark.parametrize("messages, i", NO_CONTENT,
                         ids=["user", "system", "developer", "tool", "assistant"])
def test_content_is_required_except_on_an_assistant_calling_tools(served_chat, chat_llm,
                                                                  assert_no_leaks, messages,
                                                                  i):
    """OpenAI requires ``content`` on every message but an assistant's that has tool_calls;
    one sent without it rendered as empty text (HTTP 200, and offline). Now a 400 naming
    ``messages.<i>.content`` over HTTP and the same ChatTemplateError (a ValueError) from
    LLM.chat, which keeps working afterwards (no KV block held)."""
    from kvflow.entrypoints.openai_errors import OpenAIError

    expected = (f"messages.{i}.content", "missing_required_parameter")
    with pytest.raises(OpenAIError) as served:
        _served_render(served_chat, messages)
    assert (served.value.status, served.value.param, served.value.code) == (400, *expected)
    with pytest.raises(ChatTemplateError) as offline:
        chat_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert (offline.value.param, offline.value.code) == expected
    assert str(offline.value) == str(served.value)
    out = chat_llm.chat([HI], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert out[0].prompt == "<user>hi\n<assistant>" and len(out[0].outputs[0].token_ids) == 1
    assert_no_leaks(chat_llm)


def test_content_may_be_null_or_left_out_of_an_assistant_calling_tools(tok, served_chat):
    """What OpenAI accepts still renders: null content on any turn (as empty text), and no
    content on an assistant turn with tool_calls, the same as with null (oracle: the same
    turns with ``"content": None``)."""
    without = [HI, {"role": "assistant", "tool_calls": [CALL]}]
    with_null = [HI, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    assert render_chat(tok, without, chat_template=CALLS_READ, add_generation_prompt=False) \
        == render_chat(tok, with_null, chat_template=CALLS_READ, add_generation_prompt=False) \
        == "<user>hi<assistant>f"
    assert _served_render(served_chat, without) == _served_render(served_chat, with_null)
    nulls = [{"role": "system", "content": None}, {"role": "user", "content": None}]
    assert render_chat(tok, nulls) == _served_render(served_chat, nulls) == \
        "<system>\n<user>\n<assistant>"


@pytest.mark.parametrize("messages, param, code", [
    ([HI, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "42"}],
     "messages.2.tool_call_id", "missing_required_parameter"),
    ([HI, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "content": "42", "tool_call_id": None}],
     "messages.2.tool_call_id", "missing_required_parameter"),
    ([HI, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "content": "42", "tool_call_id": ""}],
     "messages.2.tool_call_id", "empty_string"),
    ([{**HI, "tool_call_id": "c1"}], "messages.0.tool_call_id", "invalid_value"),
    ([{**HI, "tool_calls": [CALL]}], "messages.0.tool_calls", "invalid_value"),
], ids=["tool_without_id", "tool_null_id", "tool_empty_id", "id_on_user", "calls_on_user"])
def test_llm_chat_checks_tool_fields_as_the_server_does(served_chat, chat_llm,
                                                        assert_no_leaks, messages, param,
                                                        code):
    """The server refused a tool message without ``tool_call_id`` (and the tool fields on
    another role) while LLM.chat rendered it; both now run the same check, so the offline
    ValueError names the same field with the same words as the server's 400."""
    from kvflow.entrypoints.openai_errors import OpenAIError

    with pytest.raises(OpenAIError) as served:
        _served_render(served_chat, messages)
    assert (served.value.status, served.value.param, served.value.code) == (400, param, code)
    with pytest.raises(ValueError, match=param) as offline:
        chat_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False,
                      chat_template=CALLS_READ)
    assert isinstance(offline.value, ChatTemplateError)
    assert (offline.value.param, offline.value.code, str(offline.value)) == \
        (param, code, str(served.value))
    assert_no_leaks(chat_llm)


def test_empty_or_non_string_tool_call_id_is_refused(served_chat, chat_llm, assert_no_leaks):
    """A tool message with ``tool_call_id: ""`` answers no call; it rendered (HTTP 200, and
    offline). Now the server's 400 and LLM.chat's ValueError say, word for word (hand-written
    oracle), that it must be a non-empty string; offline, where no schema ran, an id that is
    no string is refused the same way (the server's schema answers ``invalid_type`` for it,
    tests/e2e/test_openai_smollm.py)."""
    from kvflow.entrypoints.openai_errors import OpenAIError

    turns = [HI, {"role": "assistant", "tool_calls": [CALL]}]
    with pytest.raises(OpenAIError) as served:
        _served_render(served_chat, [*turns, {"role": "tool", "content": "42",
                                              "tool_call_id": ""}])
    assert served.value.status == 400
    assert served.value.body()["error"] == {
        "message": "messages.2.tool_call_id must be a non-empty string (the id of the call "
                   "this result answers), got ''",
        "type": "invalid_request_error", "param": "messages.2.tool_call_id",
        "code": "empty_string"}
    for call_id, code in (("", "empty_string"), (7, "invalid_type")):
        with pytest.raises(ValueError) as offline:
            chat_llm.chat([*turns, {"role": "tool", "content": "42", "tool_call_id": call_id}],
                          SamplingParams(max_tokens=1), use_tqdm=False,
                          chat_template=CALLS_READ)
        expected = ("messages.2.tool_call_id must be a non-empty string (the id of the call "
                    f"this result answers), got {call_id!r}")
        assert (offline.value.param, offline.value.code, str(offline.value)) == (
            "messages.2.tool_call_id", code, expected)
    ok = [*turns, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert render_chat(served_chat.engine.tokenizer, ok, chat_template=CALLS_READ,
                       add_generation_prompt=False) == "<user>hi<assistant>f<tool>42"
    assert_no_leaks(chat_llm)


def test_offline_roles_are_the_servers():
    """LLM.chat takes the roles the server's ChatMessage schema takes, no more (a 'wizard'
    message is a 400 at messages.N.role there and a ChatTemplateError here)."""
    import typing

    from kvflow.chat.messages import ROLES
    from kvflow.entrypoints.protocol.chat import ChatMessage
    assert set(typing.get_args(ChatMessage.model_fields["role"].annotation)) == set(ROLES)


def test_unread_kwargs_dropped_when_the_caller_asks(tok):
    """``on_unread_kwargs`` (a server under --ignore-unknown-fields): a key the template never
    reads is dropped and reported, the text the one without it; a key it reads still
    renders."""
    told = []
    hi = [{"role": "user", "content": "hi"}]
    got = render_chat(tok, hi, template_kwargs={"zz_unused": 1, "b_unused": 2},
                      on_unread_kwargs=told.append)
    assert (got, told) == (render_chat(tok, hi), [["b_unused", "zz_unused"]])
    assert render_chat(tok, hi, chat_template="{{ x }}!", template_kwargs={"x": "q", "y": 1},
                       on_unread_kwargs=told.append) == "q!"
    assert told[-1] == ["y"]
