"""Structured output and tool calling through the server, on the tiny random model (the
grammar forces the shape): response_format, the structured_outputs extra field, tool_choice
named / required / auto (Hermes parser), streamed tool-call deltas joining to the whole
arguments, ``length`` for a cut call, and 400s for bad schemas, regexes and tool choices."""

from __future__ import annotations

import json
import math
import re

import httpx
import jsonschema
import pytest

MODEL = "tiny"
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128", "--block-size", "8",
        "--max-model-len", "256", "--served-model-name", MODEL]
# The tiny template, plus the tool names (so tools reach the template's ``tools`` argument).
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} "
                  "{% endfor %}\n{% endif %}{% for m in messages %}<{{ m['role'] }}>"
                  "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>"
                  "{% endif %}")
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
CHOICES = ["北京🙂", "東京タワー", "kvflow ✓"]


def tools_model(tiny_llama, built_models) -> str:
    """The tiny Llama with ``TOOLS_TEMPLATE`` as its chat template (one folder per session)."""
    return built_models.with_chat_template("tiny_tools", tiny_llama.path, TOOLS_TEMPLATE)


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(tools_model(fixture("tiny_llama"), fixture("built_models")), ARGS, None)]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 48)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


def test_response_format_json_schema(client):
    for seed in range(3):
        resp = chat(client, temperature=0.8, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
        choice = resp.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert choice.message.content.startswith("{")  # the grammar forces an object
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_on_completions(client):
    resp = client.completions.create(model=MODEL, prompt="the quick", max_tokens=32,
                                     temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    text = resp.choices[0].text
    assert text.startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_regex_and_choice(client):
    resp = chat(client, extra_body={"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}})
    assert re.fullmatch(r"[a-z]{3}-\d{2}", resp.choices[0].message.content)
    assert resp.choices[0].finish_reason == "stop"
    for seed in range(3):
        whole = chat(client, temperature=1.0, seed=seed,
                     extra_body={"structured_outputs": {"choice": CHOICES}})
        pieces = [c.choices[0].delta.content or ""
                  for c in chat(client, temperature=1.0, seed=seed, stream=True,
                                extra_body={"structured_outputs": {"choice": CHOICES}})
                  if c.choices]
        assert whole.choices[0].message.content in CHOICES
        assert "".join(pieces) == whole.choices[0].message.content


def test_ignore_eos_ends_with_stop_once_the_grammar_completes(client):
    """The only choice, then the EOS it requires: ``ignore_eos`` cannot go past it, and the
    reply ends with ``stop`` (it was ``length``), whole and streamed."""
    body = {"ignore_eos": True, "structured_outputs": {"choice": ["yes"]}}
    resp = chat(client, max_tokens=9, extra_body=body)
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == ("yes", "stop")
    finishes = [c.choices[0].finish_reason for c in chat(client, max_tokens=9, stream=True,
                                                         extra_body=body) if c.choices]
    assert [f for f in finishes if f] == ["stop"]


def _streamed_calls(stream):
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_named_tool_choice_whole_and_streamed(client):
    """A named function's call, whole and streamed; finish_reason "stop" both ways, as OpenAI
    answers under a named tool_choice (and "tool_calls" under required: vLLM PR 25054's
    table); kvflow said "tool_calls"."""
    request = {"tools": TOOLS, "seed": 3, "temperature": 0.7, "max_tokens": 64,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    resp = chat(client, **request)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    streamed, finish = _streamed_calls(chat(client, stream=True, **request))
    assert finish == "stop"
    assert [(c["name"], c["arguments"]) for c in streamed] == \
        [("get_weather", call.function.arguments)]


def test_required_tool_choice(client):
    resp = chat(client, tools=TOOLS, tool_choice="required", seed=1, temperature=0.7,
                max_tokens=96)
    choice = resp.choices[0]
    if choice.finish_reason == "length":
        pytest.skip("the random model wandered to max_tokens")
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        schema = next(t["function"]["parameters"] for t in TOOLS
                      if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_auto_tool_choice_parses_hermes_calls(client):
    """The tiny model cannot decide to call a tool, so a regex forces Hermes-format text;
    under tool_choice=auto the Hermes parser must find the call, whole and streamed."""
    forced = (r'Sure\.<tool_call>\{"name": "add", "arguments": \{"a": [1-9]\}\}</tool_call>')
    request = {"tools": TOOLS, "tool_choice": "auto", "max_tokens": 160,
               "extra_body": {"structured_outputs": {"regex": forced}}}
    resp = chat(client, **request)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments)["a"] in range(10)
    streamed, finish = _streamed_calls(chat(client, stream=True, **request))
    assert finish == "tool_calls"
    assert streamed[0]["arguments"] == call.function.arguments


def test_auto_parallel_tool_calls_false_returns_one_call(client):
    """parallel_tool_calls: false under tool_choice auto: the (regex-forced) text holds two
    Hermes calls; the reply carries only the first, whole and streamed (it carried both)."""
    forced = (r'<tool_call>\{"name": "add", "arguments": \{"a": 1\}\}</tool_call>'
              r'<tool_call>\{"name": "add", "arguments": \{"a": 2\}\}</tool_call>')
    request = {"tools": TOOLS, "tool_choice": "auto", "max_tokens": 160,
               "extra_body": {"structured_outputs": {"regex": forced}}}
    both = chat(client, **request).choices[0].message.tool_calls
    assert [c.function.arguments for c in both] == ['{"a": 1}', '{"a": 2}']
    choice = chat(client, parallel_tool_calls=False, **request).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("add", '{"a": 1}')]
    streamed, finish = _streamed_calls(chat(client, stream=True, parallel_tool_calls=False,
                                            **request))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [("add", '{"a": 1}')]


def test_tool_call_cut_by_max_tokens_reports_length(client):
    """A call cut by max_tokens ends with "length", and the whole message carries what the
    stream sent: the call with its partial (unparseable) arguments, no raw JSON content."""
    request = {"tools": TOOLS, "max_tokens": 4,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    resp = chat(client, **request)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "length"
    assert not message.content
    streamed, finish = _streamed_calls(chat(client, stream=True, **request))
    assert finish == "length"
    whole = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert whole == [(c["name"], c["arguments"]) for c in streamed]
    assert whole[0][0] == "get_weather" and not _is_json(whole[0][1])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _raw_stream(server, body):
    """The chunks of a streamed chat reply to ``body``, as JSON."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": MESSAGES, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_streams_each_call_once(server, client, parallel):
    """tool_choice required, streamed: each call's first delta carries its index, id, type
    and name (once; arguments ""), later ones only argument pieces; they join to the whole
    reply's calls (the same seed), finish_reason "tool_calls" (or "length"), and with
    parallel_tool_calls false exactly one call, which its grammar ends (vLLM's shape)."""
    finishes = []
    for seed in range(3):
        body = {"tools": TOOLS, "tool_choice": "required", "seed": seed, "temperature": 0.9,
                "max_tokens": 96, "parallel_tool_calls": parallel}
        whole = chat(client, **body).choices[0]
        calls, finish = {}, None
        for chunk in _raw_stream(server, body):
            (choice,) = chunk["choices"]
            finish = choice["finish_reason"] or finish
            for delta in choice["delta"].get("tool_calls") or []:
                function = delta["function"]
                if delta["index"] not in calls:
                    assert delta["id"].startswith("call_") and delta["type"] == "function"
                    assert function["name"] and function["arguments"] == ""
                    calls[delta["index"]] = [function["name"], ""]
                else:
                    assert set(delta) == {"index", "function"} and set(function) == \
                        {"arguments"}
                    calls[delta["index"]][1] += function["arguments"]
        assert sorted(calls) == list(range(len(calls)))
        assert [tuple(calls[i]) for i in sorted(calls)] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert finish == whole.finish_reason in ("tool_calls", "length")
        if not parallel:
            assert len(calls) == 1
        finishes.append(finish)
        if finish == "tool_calls":
            for name, arguments in calls.values():
                jsonschema.validate(json.loads(arguments), next(
                    t["function"]["parameters"] for t in TOOLS
                    if t["function"]["name"] == name))
    assert "tool_calls" in finishes  # the random model may write digits to max_tokens


def test_n_choices_under_a_json_schema_each_valid_and_streamed_alike(server, client):
    """n=3 under response_format json_schema: every choice that stops matches the schema,
    and each streamed choice joins to the whole reply's choice of its index."""
    body = {"n": 3, "seed": 5, "temperature": 0.9, "max_tokens": 48, "response_format": {
        "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}}
    whole = chat(client, **body)
    assert len(whole.choices) == 3
    for c in whole.choices:
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert sum(c.finish_reason == "stop" for c in whole.choices) >= 2
    texts, finishes = {}, {}
    for chunk in _raw_stream(server, body):
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
            finishes[c["index"]] = c["finish_reason"] or finishes.get(c["index"])
    assert [(texts[i], finishes[i]) for i in range(3)] == \
        [(c.message.content, c.finish_reason) for c in whole.choices]


def test_top_logprobs_under_a_grammar_are_the_masked_distribution(client):
    """Logprobs are taken after the grammar's mask, as vLLM's (its bitmask is applied to the
    logits its sampler reads): under a single choice the tokens allowed at each step are the
    prefixes of the text still to write, their probabilities sum to 1, and every other token
    is -inf, sent as vLLM's -9999.0; the EOS that ends the grammar is the only token allowed
    last (logprob log 1 = 0), and the stream carries the same entries."""
    word = "kvflow"
    body = {"logprobs": True, "top_logprobs": 20, "extra_body": {
        "structured_outputs": {"choice": [word]}}}
    choice = chat(client, **body).choices[0]
    assert (choice.message.content, choice.finish_reason) == (word, "stop")
    entries, done = choice.logprobs.content, 0
    assert "".join(e.token for e in entries[:-1]) == word and entries[-1].token == "<eos>"
    for e in entries:
        rest = word[done:]
        allowed = [t for t in e.top_logprobs if t.logprob > -9999.0]
        assert all(t.logprob == -9999.0 for t in e.top_logprobs if t not in allowed)
        assert len(allowed) < len(e.top_logprobs)  # 20 alternatives: some are masked
        assert all(rest.startswith(t.token) and t.token for t in allowed) if rest else \
            [(t.token, t.logprob) for t in allowed] == [("<eos>", 0.0)]
        assert math.isclose(sum(math.exp(t.logprob) for t in allowed), 1.0, rel_tol=1e-5)
        assert (e.token, e.logprob) in [(t.token, t.logprob) for t in allowed]
        done += len(e.token) if rest else 0
    streamed = [e for c in chat(client, stream=True, **body) if c.choices
                and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_stop_string_cuts_a_forced_call(client):
    """A stop string inside a named function's forced arguments ends the reply there
    (finish_reason "stop", stop_reason the string; the call's arguments are the text before
    it, or through it with include_stop_str_in_output), whole and streamed alike."""
    request = {"tools": TOOLS, "seed": 3, "temperature": 0.7, "max_tokens": 64,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    full = chat(client, **request).choices[0].message.tool_calls[0].function.arguments
    cut = full[:full.index(",")]
    for include, expected in ((False, cut), (True, cut + ",")):
        body = {**request, "stop": [","],
                "extra_body": {"include_stop_str_in_output": include}}
        choice = chat(client, **body).choices[0]
        assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", ",")
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] \
            == [("get_weather", expected)]
        streamed, finish = _streamed_calls(chat(client, stream=True, **body))
        assert finish == "stop"
        assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", expected)]


def test_unbounded_grammar_ends_with_length(client):
    resp = chat(client, max_tokens=8,
                extra_body={"structured_outputs": {"grammar": 'root ::= "a" root'}})
    assert resp.choices[0].finish_reason == "length"


def test_allowed_token_ids_missing_the_schema_start_get_400(server, built_models, tiny_llama):
    """Letters-only allowed_token_ids cannot begin a JSON object (``{`` or whitespace
    first): a 400 naming allowed_token_ids, not an empty ``length`` reply."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tools_model(tiny_llama, built_models))
    letters = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).isalpha()]
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 8, "allowed_token_ids": letters,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "weather", "schema": SCHEMA}}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("allowed_token_ids", "invalid_value")
    assert error["message"].startswith(
        "allowed_token_ids allows none of the tokens the JSON schema can start with")


EMPTY_AFTER_A_PREFIX = "ab[^\\s\\S]"  # "ab", then a class holding nothing


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs.regex"),
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ({"structured_outputs": {"regex": EMPTY_AFTER_A_PREFIX}}, "structured_outputs.regex"),
    ({"guided_regex": EMPTY_AFTER_A_PREFIX}, "guided_regex"),
    ({"response_format": {"type": "structural_tag", "format": {
        "type": "regex", "pattern": EMPTY_AFTER_A_PREFIX}}}, "response_format.format.pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "patternProperties": {"^k[^\\s\\S]$": {"type": "integer"}}}}}},
     "response_format.json_schema.schema"),
])
def test_a_grammar_matching_no_text_gets_400(server, body, param):
    """A regex (or a ``patternProperties`` name) no text matches, its every match going
    through an empty character class (``regex_empty``), is a 400 naming the field that held
    it, not a ``length`` reply; the server keeps serving. xgrammar compiles such a regex:
    at the start (``[^\\s\\S]``) its first step allowed no token (the engine's first-step
    check refused it); after a prefix (``ab``, or an object's ``{"``) the reply was a 200
    cut off there."""
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 8, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert "matches no string" in error["message"], error
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2,
        "structured_outputs": {"regex": "[ab]+"}})
    assert ok.status_code == 200 and set(ok.json()["choices"][0]["message"]["content"]) <= \
        {"a", "b"}


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "frobnicate"),
    ({"structured_outputs": {"regex": "(abc"}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "nowhere"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    # the schema was ignored: any object, or free text
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {
        "type": "array"}}}}, "response_format.json_schema applies to type json_schema only"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
     "the type is 'text'"),
    # a group's count past kvflow's linear budget (converted in seconds, the server
    # answering nobody meanwhile; xgrammar's own conversion took ~95 s for [a-z]{1,50000})
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^(ab){1,500000}$"}}}},
     ("invalid JSON schema in response_format.json_schema.schema: the pattern "
      "'^(ab){1,500000}$' at pattern "
      "repeats up to 500000 times")),
])
def test_bad_constraints_get_400(server, body, needle):
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200


def test_overlapping_counts_past_the_compile_budget_get_400_naming_the_grammar(server):
    """``count_budget``: a class counted right before a character it also matches costs
    xgrammar its count (at most 128) times the tokens the class begins, at compile time;
    past the budget (20 million checks) the request is a 400 naming the constraint's field
    and saying why, before any compile. The tiny vocabulary (~150 tokens of printable ASCII)
    needs over a thousand such counts to pass it (2,000 x 128 x ~150: 38 million), written
    as an EBNF grammar (a JSON schema with as many properties takes minutes to convert);
    one of them was 5-15 s to compile on SmolLM2's 49k vocabulary. The server goes on
    answering."""
    n = 2000
    grammar = "root ::= " + " ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(
        f'r{i} ::= [ -~]{{1,300}} [0-9] "x{i}"' for i in range(n))
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 4,
        "structured_outputs": {"grammar": grammar}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "structured_outputs.grammar", error
    assert "right before a character that class also matches" in error["message"], error
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# structural tags: free text until the trigger letter "e", then one structure; the tiny
# byte-level vocabulary writes an "e" within a few tokens under hot sampling
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"]}
WORD = {"enum": ["ok", "no"]}  # no trigger letter inside
STRUCTURES = [{"begin": "e<a>", "schema": DIGIT, "end": "</a>"},
              {"begin": "e<b>", "schema": WORD, "end": "</b>"}]
TAG = {"type": "structural_tag", "structures": STRUCTURES, "triggers": ["e"]}
STRUCTURE = re.compile(r"e<(a|b)>(.*?)</\1>", re.DOTALL)


def _count_structures(text: str, finish_reason: str) -> int:
    """Each structure's JSON is valid for its schema, and no trigger stands outside a
    structure (a reply cut by max_tokens may end inside one)."""
    found = STRUCTURE.findall(text)
    for name, body in found:
        jsonschema.validate(json.loads(body), DIGIT if name == "a" else WORD)
    assert STRUCTURE.sub("", text).count("e") <= (finish_reason == "length"), text
    return len(found)


def test_structural_tag_on_chat_and_completions(client):
    """response_format structural_tag on both endpoints, and vLLM's structured_outputs
    .structural_tag (the tag as JSON text), which gives the same reply for the same seed."""
    counts = []
    for seed in range(4):
        resp = chat(client, temperature=1.5, seed=seed, max_tokens=40, response_format=TAG)
        choice = resp.choices[0]
        counts.append(_count_structures(choice.message.content, choice.finish_reason))
        same = chat(client, temperature=1.5, seed=seed, max_tokens=40,
                    extra_body={"structured_outputs": {"structural_tag": json.dumps(TAG)}})
        assert same.choices[0].message.content == choice.message.content
        done = client.completions.create(model=MODEL, prompt="the quick", max_tokens=40,
                                         temperature=1.5, seed=seed,
                                         extra_body={"response_format": TAG})
        counts.append(_count_structures(done.choices[0].text, done.choices[0].finish_reason))
    assert sum(c > 0 for c in counts) >= 4, counts


def test_structural_tag_format_spelling(client):
    """xgrammar's ``format`` spelling: at least one tag, stop after the first."""
    fmt = {"type": "triggered_tags", "triggers": ["e"], "at_least_one": True,
           "stop_after_first": True,
           "tags": [{"type": "tag", "begin": "e<r>", "end": "</r>",
                     "content": {"type": "regex", "pattern": "[0-9]{2}"}}]}
    stopped = 0
    for seed in range(3):
        resp = chat(client, temperature=1.5, seed=seed, max_tokens=40,
                    response_format={"type": "structural_tag", "format": fmt})
        if resp.choices[0].finish_reason == "stop":
            stopped += 1
            assert re.fullmatch(r"[^e]*e<r>[0-9]{2}</r>", resp.choices[0].message.content,
                                re.DOTALL), resp.choices[0].message.content
    assert stopped >= 1


BAD_SCHEMA = [{"begin": "e<a>", "schema": {"type": "frob"}, "end": "</a>"}]


@pytest.mark.parametrize("route, body, param, needle", [
    ("chat", {"response_format": {"type": "structural_tag", "structures": STRUCTURES}},
     "response_format.triggers", "missing"),
    ("chat", {"response_format": {"type": "structural_tag", "triggers": ["e"]}},
     "response_format.structures", "missing"),
    ("chat", {"response_format": {**TAG, "triggers": ["<f"]}},
     "response_format.structures.0.begin", "'e<a>' starts with none of the triggers"),
    ("chat", {"response_format": {**TAG, "structures": BAD_SCHEMA}},
     "response_format.structures.0.schema", 'Unsupported type "frob"'),
    ("completions", {"response_format": {**TAG, "structures": BAD_SCHEMA}},
     "response_format.structures.0.schema", 'Unsupported type "frob"'),
    ("chat", {"response_format": {**TAG, "structures": [{"begin": "e", "end": ""}]}},
     "response_format.structures.0.schema", ""),
    ("chat", {"response_format": {**TAG, "format": {"type": "any_text"}}},
     "response_format.format", "not both"),
    ("chat", {"response_format": {"type": "structural_tag", "format": {"type": "frob"}}},
     "response_format", "not recognized: frob"),
    ("chat", {"response_format": {"type": "json_object", "triggers": ["e"]}},
     "response_format.triggers", "applies to type structural_tag only"),
    ("chat", {"structured_outputs": {"structural_tag": json.dumps({**TAG, "triggers": ["<"]})}},
     "structured_outputs.structural_tag", "structures.0.begin"),
])
def test_bad_structural_tags_get_400(server, route, body, param, needle):
    if route == "chat":
        url, base = "/v1/chat/completions", {"messages": MESSAGES}
    else:
        url, base = "/v1/completions", {"prompt": "the quick"}
    resp = httpx.post(f"{server.url}{url}", timeout=30,
                      json={"model": MODEL, "max_tokens": 4, **base, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert needle in error["message"], error
