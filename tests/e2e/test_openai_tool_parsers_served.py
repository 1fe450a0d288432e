"""vLLM's ``--tool-call-parser mistral`` and ``--reasoning-parser qwen3`` through the server on
the tiny random model: it cannot decide to call a tool or to think, so a regex forces text in
the format (as test_openai_structured.py does for Hermes); the server must read the calls and
the reasoning back, whole and streamed. ``mistral`` decodes replies with special tokens, so
the EOS token's text must not reach ``content`` (vLLM never outputs a stop token's text)."""

from __future__ import annotations

import json
import re

import pytest

MODEL = "tiny"
# enable_in_reasoning (vLLM's): the regexes below force the think block itself, so the
# grammar must apply from the first token (by default it starts after the reasoning)
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128", "--block-size", "8",
        "--max-model-len", "256", "--served-model-name", MODEL,
        "--structured-outputs-config", '{"enable_in_reasoning": true}',
        "--tool-call-parser", "mistral", "--reasoning-parser", "qwen3"]
# the opening <think> optional: a reply without </think> is all reasoning
R1_ARGS = [*ARGS[:-1], "deepseek_r1"]
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} "
            "{% endfor %}\n{% endif %}{% for m in messages %}<{{ m['role'] }}>"
            "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>"
            "{% if open_think is defined and open_think %}<think>\n{% endif %}"
            "{% endif %}{% if enable_thinking is defined and not enable_thinking %}"
            "{% endif %}")  # reads enable_thinking (a key no template reads is a 400)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
FORCED = r'<think>hm</think>Sure\.\[TOOL_CALLS\]add\[ARGS\]\{"a": 7\}'


def prestart_servers(fixture):
    model = fixture("built_models").with_chat_template("tiny_tool_parsers",
                                                       fixture("tiny_llama").path, TEMPLATE)
    return [(model, ARGS, None), (model, R1_ARGS, None)]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _chat(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=0,
        max_tokens=120, extra_body={"structured_outputs": {"regex": FORCED},
                                    **kwargs.pop("extra_body", {})}, **kwargs)


def _streamed(stream):
    """(content, reasoning, [(name, arguments, id)], finish_reason) joined from the chunks."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning", None) or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", "", ""])
                if d.id:
                    entry[0], entry[2] = d.function.name, d.id
                entry[1] += d.function.arguments or ""
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish


def test_mistral_calls_and_qwen3_reasoning_whole_and_streamed(client):
    choice = _chat(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."  # no EOS text, though decoded with specials
    assert choice.message.reasoning == "hm"
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("add", '{"a": 7}')
    assert len(call.id) == 9 and call.id.isalnum()
    content, reasoning, calls, finish = _streamed(_chat(client, stream=True))
    assert (content, reasoning, finish) == ("Sure.", "hm", "tool_calls")
    assert [c[:2] for c in calls] == [("add", '{"a": 7}')] and len(calls[0][2]) == 9


def test_reasoning_is_sent_as_vllm_0_32_sends_it(client):
    """The reply's reasoning is ``reasoning``, in the message and in stream deltas, as vLLM
    0.32 writes it; vLLM 0.10's ``reasoning_content`` (which kvflow wrote) is not."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
        extra_body={"structured_outputs": {"regex": FORCED}})
    message = raw.http_response.json()["choices"][0]["message"]
    assert message["reasoning"] == "hm" and "reasoning_content" not in message
    deltas = [c.delta.model_dump() for chunk in _chat(client, stream=True)
              for c in chunk.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "hm"
    assert not any("reasoning_content" in d for d in deltas)


def test_include_reasoning_false_drops_the_reasoning_logprobs_and_token_ids(client):
    """``include_reasoning: false`` (vLLM's field; it was a 400 as unknown): the reply is the
    same but for its reasoning, which is left out, whole and streamed, and so are logprobs
    and token ids, which would show it (vLLM 0.32's rule)."""
    extra = {"include_reasoning": False, "return_token_ids": True}
    shown = _chat(client, logprobs=True, extra_body={"return_token_ids": True}).choices[0]
    assert shown.logprobs is not None and shown.token_ids  # shown without the field
    choice = _chat(client, logprobs=True, extra_body=extra).choices[0]
    assert (choice.message.content, getattr(choice.message, "reasoning", None),
            choice.finish_reason) == ("Sure.", None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("add", '{"a": 7}')]
    assert choice.logprobs is None and getattr(choice, "token_ids", None) is None
    chunks = list(_chat(client, stream=True, logprobs=True, extra_body=extra))
    content, reasoning, calls, finish = _streamed(chunks)
    assert (content, reasoning, finish) == ("Sure.", "", "tool_calls")
    assert [c[:2] for c in calls] == [("add", '{"a": 7}')]
    assert all(c.logprobs is None and getattr(c, "token_ids", None) is None
               for chunk in chunks for c in chunk.choices)


def test_enable_thinking_false_leaves_the_text_to_the_tool_parser(client):
    choice = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                   ).choices[0]
    assert choice.message.content == "<think>hm</think>Sure."
    assert getattr(choice.message, "reasoning", None) is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 7}


def test_a_reply_without_calls_has_no_eos_text(client):
    """The reply is decoded with special tokens for ``[TOOL_CALLS]``; the EOS token that ended
    it is not content (it was: ``Plain.<eos>``)."""
    forced = {"extra_body": {"structured_outputs": {"regex": r"Plain\."}}}
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                            temperature=0, max_tokens=20, **forced).choices[0]
    assert (choice.message.content, choice.message.tool_calls or [], choice.finish_reason) == \
        ("Plain.", [], "stop")
    content, _, calls, finish = _streamed(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=20,
        stream=True, **forced))
    assert (content, calls, finish) == ("Plain.", [], "stop")



def test_a_prompt_that_opens_the_think_block(client):
    """A template whose generation prompt ends with ``<think>`` (Qwen3's 2507 thinking models):
    the reply is reasoning until ``</think>`` though it writes no opening tag (it was all
    content); the tiny model's reply (no ``</think>``) is all reasoning, whole and streamed.
    Under a grammar (a regex, a named tool) the reply is what the grammar forces: no
    reasoning."""
    def ask(opened, stream=False, **extra):
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, stream=stream,
            extra_body={"ignore_eos": True, **extra,
                        "chat_template_kwargs": {"open_think": opened}})

    message = ask(True).choices[0].message
    assert message.content is None and message.reasoning
    content, reasoning, _, _ = _streamed(ask(True, stream=True))
    assert (content, reasoning) == ("", message.reasoning)
    plain = ask(False).choices[0].message
    assert plain.content and getattr(plain, "reasoning", None) is None
    forced = ask(True, structured_outputs={"regex": r"Plain\."}).choices[0].message
    assert (forced.content, getattr(forced, "reasoning", None)) == ("Plain.", None)
    named = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "add"}},
        extra_body={"chat_template_kwargs": {"open_think": True}}).choices[0].message
    assert getattr(named, "reasoning", None) is None
    assert [c.function.name for c in named.tool_calls] == ["add"]



@pytest.fixture(scope="module")
def r1_client(start_server, request):
    server = start_server.declared(request, 1)
    yield server.client()
    server.terminate()


def test_forced_calls_and_json_are_not_reasoning(r1_client):
    """--reasoning-parser deepseek_r1 (opening <think> optional): the grammar of tool_choice
    required / named or response_format is applied from the first token (enable_in_reasoning;
    without it the grammar would wait for </think>, as vLLM's), so the reply is the
    forced JSON, with no </think>; it was read as all reasoning (no tool_calls, content null,
    finish_reason stop). Whole and streamed."""
    def ask(stream=False, **kwargs):
        kwargs.setdefault("max_tokens", 60)
        return r1_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, stream=stream, **kwargs)

    for choice, finish in (("required", "tool_calls"),
                           ({"type": "function", "function": {"name": "add"}}, "stop")):
        whole = ask(tools=TOOLS, tool_choice=choice).choices[0]
        assert getattr(whole.message, "reasoning", None) is None
        assert {c.function.name for c in whole.message.tool_calls} == {"add"}
        assert whole.finish_reason in (finish, "length")  # the random model may run on
        _, reasoning, calls, streamed_finish = _streamed(ask(stream=True, tools=TOOLS,
                                                             tool_choice=choice))
        assert (reasoning, streamed_finish) == ("", whole.finish_reason)
        assert [c[:2] for c in calls] == [(c.function.name, c.function.arguments)
                                          for c in whole.message.tool_calls]
    message = ask(response_format={"type": "json_object"}, max_tokens=20).choices[0].message
    assert message.content and getattr(message, "reasoning", None) is None


def test_responses_include_reasoning_false_drops_the_reasoning_items(r1_client):
    """/v1/responses' ``include_reasoning`` (vLLM 0.32's; it was a 400 as unknown): under
    deepseek_r1 the tiny model's reply (no ``</think>``) is all reasoning. The same request
    with ``include_reasoning: false`` has no reasoning item, whole or streamed (no reasoning
    event either), only the empty message, and no output logprobs; its usage equals the
    shown reply's, reasoning tokens included (vLLM counts them too)."""
    def ask(stream=False, **extra):
        return r1_client.responses.create(
            model=MODEL, input="the quick brown fox", temperature=0, max_output_tokens=6,
            stream=stream, include=["message.output_text.logprobs"], top_logprobs=2,
            extra_body=extra)

    shown, hidden = ask(), ask(include_reasoning=False)
    kinds = [item.type for item in shown.output]
    assert "reasoning" in kinds and shown.usage.output_tokens_details.reasoning_tokens > 0
    assert [item.type for item in hidden.output] == ["message"]
    (part,) = hidden.output[0].content
    assert (part.text, part.logprobs) == ("", [])
    assert hidden.usage.model_dump() == shown.usage.model_dump()
    events = list(ask(stream=True, include_reasoning=False))
    assert not any("reasoning" in event.type for event in events)
    done = events[-1].response
    assert [item.type for item in done.output] == ["message"]
    assert done.usage.model_dump() == shown.usage.model_dump()


def test_a_budget_under_a_grammar_in_the_reasoning(client, tiny_tokenizer):
    """``thinking_token_budget`` with enable_in_reasoning: the grammar applies from the first
    token (a regex that closes the block the template opened), and the budget still forces
    ``</think>`` once 4 tokens follow ``<think>`` (the prompt's ``\n`` after it included,
    vLLM's count), which the regex allows. Before, the budget's markers made the grammar
    wait for the end of the reasoning: the first tokens were free."""
    regex = r"[a-z ]{1,30}</think>Sure\."
    start = tiny_tokenizer.encode("<think>", add_special_tokens=False)
    end = tiny_tokenizer.encode("</think>", add_special_tokens=False)

    def ask(**extra):
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60,
            extra_body={"structured_outputs": {"regex": regex}, "return_token_ids": True,
                        "chat_template_kwargs": {"open_think": True}, **extra})

    head = ask(max_tokens=4)  # the grammar's own first tokens
    prompt = head.model_extra["prompt_token_ids"]
    after = next(len(prompt) - i - len(start) for i in range(len(prompt) - len(start), -1, -1)
                 if prompt[i:i + len(start)] == start)  # prompt tokens after <think>
    assert 0 < after < 4
    free = 4 - after
    reply = ask(thinking_token_budget=4).choices[0]
    tokens = reply.model_extra["token_ids"]
    assert tokens[:free + len(end)] == head.choices[0].model_extra["token_ids"][:free] + end
    text = tiny_tokenizer.decode(tokens, skip_special_tokens=True)
    assert re.fullmatch(regex, text), text
