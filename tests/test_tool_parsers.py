"""Tool-call and reasoning parsers: whole texts, and streams fed in every possible split,
whose argument pieces must join to exactly the whole-text arguments."""

from __future__ import annotations

import json

import pytest

from kvflow.entrypoints.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
    StreamingToolState,
    ThinkReasoningParser,
)

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"note": "a \\"quoted\\" }{ brace"}}\n</tool_call>\n<tool_call>\n{"name": "add", '
          '"arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>')
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "東京🙂"}}; '
          '{"name": "add", "parameters": {"a": -1.5e3}}')
REQUIRED = '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'


def _stream(parser, text: str, chunk: int, reasoning=None):
    state = StreamingToolState(parser, reasoning)
    content, think, calls = "", "", {}
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for i, piece in enumerate(pieces):
        out = state.update(piece, i == len(pieces) - 1)
        content += out.content
        think += out.reasoning
        for index, call_id, name, args in out.tool_calls:
            entry = calls.setdefault(index, {"id": None, "name": None, "arguments": ""})
            if call_id is not None:
                assert entry["id"] is None  # the header is sent once
                entry["id"], entry["name"] = call_id, name
            entry["arguments"] += args
    return content, think, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parser, text, names", [
    (HermesToolParser(), HERMES, ["get_weather", "add"]),
    (Llama3JsonToolParser(), LLAMA3, ["get_weather", "add"]),
    (RequiredToolParser(), REQUIRED, ["add", "get_weather"]),
    (NamedToolParser("add"), '{"a": 1, "b": "x"}', ["add"]),
])
def test_whole_and_streamed_calls_agree(parser, text, names):
    whole = parser.parse(text, final=True)
    assert [c.name for c in whole.calls] == names
    assert all(c.complete for c in whole.calls)
    for c in whole.calls:
        json.loads(c.arguments)
    for chunk in (1, 2, 7, len(text)):
        content, _, calls = _stream(parser, text, chunk)
        assert [c["name"] for c in calls] == names
        assert [c["arguments"] for c in calls] == [c.arguments for c in whole.calls]
        assert content.strip() == whole.content.strip()


def test_hermes_content_only_and_cut_call():
    parser = HermesToolParser()
    assert parser.parse("just text <tool", final=True).content == "just text <tool"
    assert parser.parse("just text <tool", final=False).content == "just text"
    cut = parser.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1', final=True)
    assert cut.calls[0].name == "add" and not cut.calls[0].complete


def test_llama3_plain_text_is_content():
    assert Llama3JsonToolParser().parse("Hello there", final=True).content == "Hello there"
    assert Llama3JsonToolParser().parse("Hello there", final=True).calls == []


def test_think_split_whole_and_streamed():
    text = "<think>step 1, then </thi nk> step 2</think>\n\nThe answer is 4."
    reasoning = ThinkReasoningParser()
    assert reasoning.split(text, True) == ("step 1, then </thi nk> step 2", "The answer is 4.")
    for chunk in (1, 3, len(text)):
        content, think, _ = _stream(None, text, chunk, reasoning)
        assert think == "step 1, then </thi nk> step 2"
        assert content.strip() == "The answer is 4."
    assert reasoning.split("no tags here", True) == ("", "no tags here")


@pytest.mark.parametrize("parser, text", [
    (NamedToolParser("get_weather"), '{"city":'),
    (RequiredToolParser(), '[{"name": "get_weather", "arguments": {"city": "Par'),
    (RequiredToolParser(), '[{"argument'),
])
def test_cut_call_whole_message_matches_the_stream(parser, text):
    """A reply cut by max_tokens: the non-streamed message reports what the stream sent
    (the partial call with its partial arguments, no raw JSON as content)."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    out = ChatOutputParser(parser, None)
    message, finish = out.message(text, "length")
    state = out.stream_state()
    streamed_args: dict[int, str] = {}
    streamed_names: dict[int, str] = {}
    streamed_content = ""
    for i in range(len(text)):
        delta, _ = out.delta(state, text[i], "length" if i == len(text) - 1 else None)
        if delta is None:
            continue
        streamed_content += delta.content or ""
        for call in delta.tool_calls or []:
            streamed_args[call.index] = streamed_args.get(call.index, "") + \
                (call.function.arguments or "")
            if call.function.name:
                streamed_names[call.index] = call.function.name
    assert finish == "length"
    got = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert got == [(streamed_names[i], streamed_args[i]) for i in sorted(streamed_names)]
    assert (message.content or "") == streamed_content


HISTORY_CALLS = [  # an earlier assistant turn's tool_calls, as OpenAI clients send them back
    {"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "東京", "q": "a \\"b\\" }"}'}},
    {"id": "c2", "type": "function", "function": {"name": "add", "arguments": ""}}]


HERMES_HISTORY = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "q": "a \\"b\\" }"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>')
LLAMA3_HISTORY = ('{"name": "get_weather", "parameters": {"city": "東京", "q": "a \\"b\\" }"}}; '
                  '{"name": "add", "parameters": {}}')


@pytest.mark.parametrize("parser,expected", [(HermesToolParser(), HERMES_HISTORY),
                                             (Llama3JsonToolParser(), LLAMA3_HISTORY)],
                         ids=["hermes", "llama3_json"])
def test_history_calls_as_text_parse_back(parser, expected):
    """A template that renders no tool_calls gets them as the parser's own text (hand-written
    expectation: the arguments text verbatim, empty arguments as {}); the parser reads the
    same calls back from it."""
    text = parser.calls_text(HISTORY_CALLS)
    assert text == expected
    parsed = parser.parse(text, True)
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.calls] == \
        [("get_weather", {"city": "東京", "q": 'a "b" }'}, True), ("add", {}, True)]


def _chat_stream(out, text: str, chunk: int, finish: str):
    """(content or None, [(name, arguments)] or None, finish_reason) as a client joins a
    stream of ``text`` in ``chunk``-character deltas through ``ChatOutputParser.delta``."""
    state, content, calls, reason = out.stream_state(), "", {}, None
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for i, piece in enumerate(pieces):
        delta, reason = out.delta(state, piece, finish if i == len(pieces) - 1 else None)
        for call in (delta.tool_calls or []) if delta else []:
            entry = calls.setdefault(call.index, [None, ""])
            entry[0] = call.function.name or entry[0]
            entry[1] += call.function.arguments or ""
        content += (delta.content or "") if delta else ""
    return content or None, [tuple(calls[i]) for i in sorted(calls)] or None, reason


@pytest.mark.parametrize("parser, text, expected", [
    # whitespace before a call: not sent as content by the stream either
    (HermesToolParser(), 'Hi \n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
     ("Hi", [("f", '{"a": 1}')], "tool_calls")),
    # arguments that are not JSON: the stream sent them, so the message has them too
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {bad}}</tool_call>',
     (None, [("f", "{bad}")], "tool_calls")),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": 1',
     (None, [("f", '{"a": 1')], "tool_calls")),
    # a nameless object is no call, and does not shift the next call's index
    (HermesToolParser(), ('<tool_call>{"x": 1}</tool_call><tool_call>{"name": "g", '
                          '"arguments": {}}</tool_call>'), (None, [("g", "{}")], "tool_calls")),
    # no arguments member: {} (JSON text), not ""
    (HermesToolParser(), '<tool_call>{"name": "f"}</tool_call>',
     (None, [("f", "{}")], "tool_calls")),
    # no usable call: the model's text is content, not dropped
    (HermesToolParser(), 'See <tool_call>not json</tool_call>',
     ("See <tool_call>not json</tool_call>", None, "stop")),
    (Llama3JsonToolParser(), '{"answer": 42}', ('{"answer": 42}', None, "stop")),
    # forced arguments: surrounding whitespace is never streamed
    (NamedToolParser("f"), '  {"a": 1}  ', (None, [("f", '{"a": 1}')], "tool_calls")),
    # text after and between calls is content (it was dropped), a line per stretch
    (HermesToolParser(), 'Hi\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n Done. ',
     ("Hi\nDone.", [("f", "{}")], "tool_calls")),
    (HermesToolParser(), ('<tool_call>{"name": "f", "arguments": {}}</tool_call> mid '
                          '<tool_call>{"name": "g", "arguments": {}}</tool_call>end'),
     ("mid\nend", [("f", "{}"), ("g", "{}")], "tool_calls")),
    # a key written twice, or both argument keys: the first in the text, which the stream
    # sent before the second came (the whole reply took the last, or llama3's "parameters"
    # wherever it stood: '{"a": 2}', 'g', '{"a": 1}', which the stream's joined deltas
    # contradicted; vLLM 0.32's hermes takes the last and streams garbage for these)
    (HermesToolParser(), ('<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": '
                          '{"a": 2}}</tool_call>'), (None, [("f", '{"a": 1}')], "tool_calls")),
    (HermesToolParser(), '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
     (None, [("f", "{}")], "tool_calls")),
    (Llama3JsonToolParser(), '{"name": "f", "arguments": {"b": 2}, "parameters": {"a": 1}}',
     (None, [("f", '{"b": 2}')], "tool_calls")),
], ids=["hermes-ws", "hermes-bad-json", "llama3-unclosed", "hermes-nameless",
        "hermes-no-args", "hermes-no-json", "llama3-json-reply", "named-ws", "hermes-after",
        "hermes-between", "hermes-dup-arguments", "hermes-dup-name", "llama3-two-arg-keys"])
def test_malformed_output_streamed_equals_whole(parser, text, expected):
    """Hand-written expectations for odd model output; the stream, split every way, joins to
    exactly the non-streamed message (content, calls, finish_reason)."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    out = ChatOutputParser(parser, None)
    message, finish = out.message(text, "stop")
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert (message.content, calls or None, finish) == expected
    for chunk in range(1, len(text) + 1):
        assert _chat_stream(out, text, chunk, "stop") == expected, chunk


HERMES_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("text", [
    HERMES_TIME[:-len("l>")], HERMES_TIME[:-len("</tool_call>") + 1],
    HERMES_TIME + "\n<tool_ca", HERMES_TIME + "\n<", HERMES_TIME + "<tool_call",
], ids=["in-end-tag", "end-tag-<", "in-next-tag", "next-tag-<", "next-tag-no-ws"])
def test_hermes_reply_cut_inside_a_tag_has_no_content(text):
    """max_tokens cut the reply inside a tag after a finished call: the piece of tag is the
    calls' markup, not content (it was '</tool_ca' / '<tool_ca' as content). Oracle: vLLM
    0.32's hermes parser streams this reply as the call and no content (its whole reply, for
    the cut opening tag, too: call get_time, content None; for the cut closing tag its
    json.loads of the block fails and it returns all the text as content with no call, which
    its own stream contradicts). The stream, split every way, joins to the same message."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    out = ChatOutputParser(HermesToolParser(), None)
    message, finish = out.message(text, "length")
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    expected = (None, [("get_time", "{}")], "length")
    assert (message.content, calls, finish) == expected
    for chunk in range(1, len(text) + 1):
        assert _chat_stream(out, text, chunk, "length") == expected, chunk


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call>',
     ("junk", [("f", '{"a": 1}')], "tool_calls")),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}}</tool_call>',  # one brace too many
     ("}", [("f", '{"a": 1}')], "tool_calls")),
    (('Hi <tool_call>{"name": "f", "arguments": {}} note\n</tool_call>\n after <tool_call>'
      '{"name": "g", "arguments": {}} x</tool_call>'),
     ("Hi\nnote\nafter\nx", [("f", "{}"), ("g", "{}")], "tool_calls")),
    ('<tool_call>{"name": "f", "arguments": {}} junk</tool_ca',  # max_tokens in the tag
     ("junk", [("f", "{}")], "tool_calls")),
], ids=["junk", "extra-brace", "inside-and-after", "cut-in-end-tag"])
def test_hermes_text_after_the_call_inside_its_block_is_content_without_the_tag(text,
                                                                                 expected):
    """Text the model wrote between a call's object and its ``</tool_call>`` is content, a
    stretch of its own, and the closing tag is not (content was 'junk</tool_call>'). vLLM
    0.32's hermes (recorded): its whole reply has no call and all the text as content (the
    block's json.loads fails), while its stream sends call f with arguments '{"a": 1}} junk'
    and no content; kvflow's stream sends the call once its object is read, before the junk
    comes, so the message keeps the call (stream == whole) and the junk as content. The
    stream, split every way, joins to the same message."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    out = ChatOutputParser(HermesToolParser(), None)
    message, finish = out.message(text, "stop")
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert (message.content, calls, finish) == expected
    for chunk in range(1, len(text) + 1):
        assert _chat_stream(out, text, chunk, "stop") == expected, chunk


def test_parallel_tool_calls_false_keeps_the_first_call():
    """parallel_tool_calls: false (max_calls=1) under tool_choice auto: the model wrote two
    calls; the reply carries only the first, streamed or not (it carried both)."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    out = ChatOutputParser(HermesToolParser(), None, max_calls=1)
    expected = ("Hi", [("get_weather", '{"city": "Paris", "note": "x"}')], "tool_calls")
    text = ('Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "note": "x"}}'
            '</tool_call><tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    message, finish = out.message(text, "stop")
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert (message.content, calls, finish) == expected
    for chunk in (1, 5, len(text)):
        assert _chat_stream(out, text, chunk, "stop") == expected
    assert len(ChatOutputParser(HermesToolParser(), None).message(text, "stop")[0]
               .tool_calls) == 2


@pytest.mark.parametrize("parser", [None, Llama3JsonToolParser()], ids=["no-tools", "llama3"])
def test_spaces_after_think_do_not_eat_the_end_of_the_stream(parser):
    """Spaces after </think>: the whole reply stripped them but the stream had sent them, so
    the stream's last characters were never sent ('  Hi' for 'Hi!'). Both now strip them."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    text = "<think>r</think>  \n Hi!"
    out = ChatOutputParser(parser, ThinkReasoningParser())
    message, _ = out.message(text, "stop")
    assert (message.reasoning, message.content) == ("r", "Hi!")
    for chunk in range(1, len(text) + 1):
        assert _chat_stream(out, text, chunk, "stop") == ("Hi!", None, "stop"), chunk


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), '<tool_call>{"a\\x": 1, "name": "f", "arguments": {}}</tool_call>'),
    (Llama3JsonToolParser(), '{"a\nb": 1, "name": "f", "arguments": {}}'),
    (RequiredToolParser(), '[{"\\u12": 1, "name": "f", "arguments": {}}]'),
], ids=["bad-escape", "raw-newline", "short-unicode-escape"])
def test_member_name_that_is_not_json_does_not_raise(parser, text):
    """A model's member name with a bad escape or a raw control character raised
    JSONDecodeError out of the parser (the request failed); it now names no member, and the
    call is read, streamed or not."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    out = ChatOutputParser(parser, None)
    message, finish = out.message(text, "stop")
    expected = (None, [("f", "{}")], "tool_calls")
    assert (message.content, [(c.function.name, c.function.arguments)
                              for c in message.tool_calls], finish) == expected
    assert _chat_stream(out, text, 1, "stop") == expected


@pytest.mark.parametrize("parser", [None, HermesToolParser()], ids=["no-tools", "hermes"])
@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("Hello there!", None, "Hello there!"),        # no think block: no reasoning
    ("<think></think>Hi", None, "Hi"),             # an empty one: none written either
    ("<think>hm</think>Hi", "hm", "Hi"),
])
def test_whole_reply_reasoning_is_what_the_stream_sends(parser, text, reasoning, content):
    """The whole reply's reasoning_content is what the streamed deltas carry, joined: a reply
    that wrote none had "" (the JSON said "reasoning": "") where the stream sends no
    reasoning_content at all (and vLLM's qwen3 / think parsers answer null)."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    out = ChatOutputParser(parser, ThinkReasoningParser())
    message, _ = out.message(text, "stop")
    state, streamed = out.stream_state(), ""
    for i, char in enumerate(text):
        delta, _ = out.delta(state, char, "stop" if i == len(text) - 1 else None)
        streamed += (delta.reasoning or "") if delta else ""
    assert (message.reasoning, message.content) == (reasoning, content)
    assert (streamed or None) == reasoning


def test_reasoning_is_written_as_reasoning():
    """vLLM 0.32 writes a reply's reasoning as ``reasoning`` (message and stream delta) and
    no longer as vLLM 0.10's ``reasoning_content``, which kvflow wrote."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    out = ChatOutputParser(None, ThinkReasoningParser())
    message, _ = out.message("<think>hm</think>Hi", "stop")
    assert message.model_dump() == {"role": "assistant", "content": "Hi", "reasoning": "hm"}
    delta, _ = out.delta(out.stream_state(), "<think>hm", None)
    assert delta.model_dump() == {"reasoning": "hm"}


@pytest.mark.parametrize("parser", [None, HermesToolParser()], ids=["no-tools", "hermes"])
@pytest.mark.parametrize(("text", "content", "calls"), [
    ("<think>hm</think>Hi", "Hi", None),
    ('<think>hm</think>Hi<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
     "Hi", [("f", '{"a": 1}')]),
    ("<think>cut sho", None, None),  # all reasoning: nothing left
], ids=["content", "call", "all-reasoning"])
def test_include_reasoning_false_drops_the_reasoning(parser, text, content, calls):
    """``include_reasoning: false`` (vLLM's field): the reasoning is split off and dropped,
    whole and streamed; a delta holding only reasoning is not sent at all. Without a tool
    parser the call's text is content."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    if parser is None and calls:
        content, calls = text.split("</think>")[1], None
    out = ChatOutputParser(parser, ThinkReasoningParser(), include_reasoning=False)
    assert out.hides_reasoning and not ChatOutputParser(parser, ThinkReasoningParser()) \
        .hides_reasoning and not ChatOutputParser(parser, None, include_reasoning=False) \
        .hides_reasoning
    message, _ = out.message(text, "stop")
    assert message.reasoning is None and message.content == content
    assert ([(c.function.name, c.function.arguments)
             for c in message.tool_calls or []] or None) == calls
    state = out.stream_state()
    for i, char in enumerate(text):
        delta, _ = out.delta(state, char, "stop" if i == len(text) - 1 else None)
        assert delta is None or (delta.reasoning is None and (delta.content or delta.tool_calls))
    finish = "tool_calls" if calls else "stop"
    assert _chat_stream(out, text, 1, "stop") == (content, calls, finish)


@pytest.mark.parametrize("parser", [None, HermesToolParser()], ids=["no-tools", "hermes"])
def test_reply_that_is_all_reasoning_has_null_content(parser):
    """An unclosed (cut) think block: the stream sends no content; the whole reply said ""
    without a tool parser and null with one. Both are null now; an empty plain reply (no
    reasoning parser) keeps OpenAI's ""."""
    from kvflow.entrypoints.chat_output import ChatOutputParser

    message, _ = ChatOutputParser(parser, ThinkReasoningParser()).message("<think>a b",
                                                                          "length")
    assert (message.reasoning, message.content) == ("a b", None)
    assert ChatOutputParser(None, None).message("", "stop")[0].content == ""


QWEN3_THINKING_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("parser", [None, HermesToolParser()], ids=["no-tools", "hermes"])
@pytest.mark.parametrize(("prompt", "text", "reasoning", "content"), [
    # the template opened the block (Qwen3-Thinking-2507): the reply writes only </think>
    (QWEN3_THINKING_PROMPT, "Add 2 and 2.\n</think>\n\nIt is 4.", "Add 2 and 2.\n", "It is 4."),
    (QWEN3_THINKING_PROMPT, "Still thinking", "Still thinking", None),  # cut by max_tokens
    (QWEN3_THINKING_PROMPT, "<think>r</think>Hi", "r", "Hi"),  # the reply opens it again
    # the prompt did not open it: a reply without <think> stays content, </think> included
    ("<|im_start|>assistant\n", "a</think>b", None, "a</think>b"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hi", None, "Hi"),  # closed: no think
])
def test_prompt_that_opens_the_think_block(parser, prompt, text, reasoning, content):
    """A chat template that ends its generation prompt with <think> (Qwen3's 2507 thinking
    models, DeepSeek-R1's): the reply is "reasoning</think>answer". qwen3 read it all as
    content, '</think>' included (vLLM reads the reasoning: its qwen3 parser takes the text
    before </think> as reasoning without an opening tag); the rendered prompt's end now says
    the reply starts in the block. Whole and streamed, character by character."""
    from kvflow.entrypoints.chat_output import ChatOutputParser
    from kvflow.entrypoints.tool_parsers import make_reasoning_parser

    out = ChatOutputParser(parser, make_reasoning_parser("qwen3", {}))
    out.note_prompt(prompt)
    message, _ = out.message(text, "stop")
    assert (message.reasoning, message.content) == (reasoning, content)
    state, streamed, sent = out.stream_state(), "", ""
    for i, char in enumerate(text):
        delta, _ = out.delta(state, char, "stop" if i == len(text) - 1 else None)
        streamed += (delta.reasoning or "") if delta else ""
        sent += (delta.content or "") if delta else ""
    assert (streamed or None, sent or None) == (reasoning, content)


@pytest.mark.parametrize("name", ["deepseek_r1", "step3", "seed_oss", "ernie45", "deepseek_v3",
                                  "qwen3"])
@pytest.mark.parametrize("prompt", ["<|im_start|>assistant\n", QWEN3_THINKING_PROMPT])
def test_grammar_forced_reply_is_not_reasoning(name, prompt):
    """Under a grammar (tool_choice required / named, response_format), applied from the first
    token, the reply is the forced JSON: parsers whose opening marker is optional
    (deepseek_r1, step3, seed_oss, ernie45, deepseek_v3) read it, having no </think>, as all
    reasoning, so the forced calls were lost (no tool_calls, content null, finish stop) and
    a forced JSON reply had null content. A reply that writes the opening marker still has
    its reasoning. Whole and char-by-char streamed."""
    from kvflow.entrypoints.chat_output import ChatOutputParser
    from kvflow.entrypoints.tool_parsers import make_reasoning_parser

    def reply(tool_parser, text, calls_finish="tool_calls"):
        out = ChatOutputParser(tool_parser, make_reasoning_parser(name, {"thinking": True}),
                               calls_finish=calls_finish)
        out.note_prompt(prompt, grammar=True)
        message, finish = out.message(text, "stop")
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return out, (message.content, message.reasoning, calls or None, finish)

    out, whole = reply(RequiredToolParser(), '[{"name": "add", "arguments": {"a": 1}}]')
    assert whole == (None, None, [("add", '{"a": 1}')], "tool_calls")
    text = '[{"name": "add", "arguments": {"a": 1}}]'
    assert _chat_stream(out, text, 1, "stop") == (None, [("add", '{"a": 1}')], "tool_calls")
    assert reply(NamedToolParser("add"), '{"a": 2}', "stop")[1] == \
        (None, None, [("add", '{"a": 2}')], "stop")
    assert reply(None, '{"a": 3}')[1] == ('{"a": 3}', None, None, "stop")
    markers = make_reasoning_parser(name, {"thinking": True})
    if markers.STARTS:  # a forced reply that writes the block itself (a regex) keeps it
        text = f"{markers.STARTS[0]}r{markers.ENDS[0]}Hi"
        assert reply(None, text)[1][:2] == ("Hi", "r")
