"""Differential check of kvflow's OpenAI server against vLLM's on the same model: send the
same requests to both and print where the JSON responses differ.

Start both servers on the same folder and dtype first, then point the script at them:

    VLLM_CPU_KVCACHE_SPACE=2 $VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server \\
        --model out/smollm2-hf --dtype bfloat16 --port 8001 &
    PYTHONPATH=. .venv/bin/python -m kvflow.entrypoints.cli serve out/smollm2-hf \\
        --dtype bfloat16 --port 8002 &
    PYTHONPATH=. .venv/bin/python benchmarks/vllm_api_diff.py \\
        --vllm http://127.0.0.1:8001 --kvflow http://127.0.0.1:8002 [-k NAME] [--messages]

Each case (``CASES``: completions, chat, tokenize/detokenize, /v1/models, bad input, streams)
prints ``== name: same`` or one line per difference:

- structure: a field present in one reply only (``only kvflow`` / ``only vllm``), ``null`` on
  one side and absent on the other, or different JSON types;
- values: greedy text and token ids, finish/stop reasons and usage exactly; logprobs within
  ``--tol`` (0.05: bf16 kernels differ); a ``top_logprobs`` alternative set, and a greedy
  token at a top-2 gap above ``--tie`` (0.1), are exact;
- errors: status code, ``error.type`` / ``error.code`` / ``error.param`` exactly; the
  messages are printed (``--messages``) but not compared;
- streams: SSE framing (``data: `` events, a final ``data: [DONE]``), the first chunk
  (role), the chunk that carries each choice's finish_reason, the usage chunk, and each
  choice's concatenated deltas.

Volatile fields (``id`` beyond its prefix, ``created``, ``system_fingerprint``, the
tokenizer's ``max_model_len`` where the servers' contexts differ) are skipped. Exit status 0
(2 when a server does not answer ``/v1/models``);
the differences are for a person to judge (docs/coming-from-vllm.md lists the deliberate
ones; docs/benchmarks.md the last run's findings).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

import httpx

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
IGNORED = {"created", "system_fingerprint", "root", "max_model_len"}


@dataclass(frozen=True)
class Case:
    """One request sent to both servers: ``body`` None is a GET."""

    name: str
    path: str
    body: dict[str, Any] | None = None
    stream: bool = False


def _cmp(**kw: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"messages": CHAT, "max_tokens": 8, "temperature": 0, **kw}


C, CH = "/v1/completions", "/v1/chat/completions"
CONT = [*CHAT, {"role": "assistant", "content": "Red,"}]
SPECIAL = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
USAGE = {"include_usage": True}
TOOL = {"type": "function", "function": {"name": "get_colour", "description": "A colour.",
                                         "parameters": {"type": "object", "properties": {
                                             "n": {"type": "integer"}}, "required": ["n"]}}}
CASES = [
    Case("models", "/v1/models"),
    Case("cmpl_greedy", C, _cmp()),
    Case("cmpl_logprobs", C, _cmp(logprobs=3)),
    Case("cmpl_logprobs0", C, _cmp(logprobs=0)),
    Case("cmpl_echo", C, _cmp(echo=True, logprobs=1)),
    Case("cmpl_echo_max0", C, _cmp(echo=True, max_tokens=0)),
    Case("cmpl_echo_ids", C, _cmp(echo=True, return_token_ids=True)),
    Case("cmpl_max0", C, _cmp(max_tokens=0)),
    Case("cmpl_max_null", C, _cmp(max_tokens=None, prompt="Hi<|im_end|>")),
    Case("cmpl_prompt_logprobs", C, _cmp(prompt_logprobs=2)),
    Case("cmpl_prompt_logprobs0", C, _cmp(prompt_logprobs=0)),
    Case("cmpl_stop", C, _cmp(max_tokens=16, stop=["."])),
    Case("cmpl_stop_incl", C, _cmp(max_tokens=16, stop=["."], include_stop_str_in_output=True)),
    Case("cmpl_stop_multi", C, _cmp(max_tokens=16, stop=["answer", "\n\n"])),
    Case("cmpl_stop_token_ids", C, _cmp(max_tokens=16, stop_token_ids=[30])),
    Case("cmpl_stop_token_incl", C, _cmp(max_tokens=16, stop_token_ids=[30],
                                         include_stop_str_in_output=True)),
    Case("cmpl_n2", C, _cmp(n=2, temperature=1.0, top_k=1)),
    Case("cmpl_n2_greedy", C, _cmp(n=2)),
    Case("cmpl_min_tokens_eos", C, _cmp(prompt="Say hi.<|im_end|>", max_tokens=6, min_tokens=4)),
    Case("cmpl_min_tokens_stop", C, _cmp(max_tokens=16, min_tokens=8, stop=["."])),
    Case("cmpl_ignore_eos", C, _cmp(max_tokens=20, ignore_eos=True)),
    Case("cmpl_special", C, {"prompt": SPECIAL, "max_tokens": 12, "temperature": 0,
                             "skip_special_tokens": False}),
    Case("cmpl_special_spaces", C, {"prompt": "<|im_start|>user\nHi<|im_end|>\n",
                                    "max_tokens": 12, "temperature": 0,
                                    "skip_special_tokens": False,
                                    "spaces_between_special_tokens": False}),
    Case("cmpl_special_logprobs", C, {"prompt": SPECIAL, "max_tokens": 12, "temperature": 0,
                                      "skip_special_tokens": False, "logprobs": 1,
                                      "ignore_eos": True}),
    Case("cmpl_add_special", C, _cmp(add_special_tokens=False)),
    Case("cmpl_truncate", C, _cmp(truncate_prompt_tokens=3, echo=True)),
    Case("cmpl_truncate_usage", C, _cmp(truncate_prompt_tokens=3)),
    Case("cmpl_token_prompt", C, _cmp(prompt=[504, 3575, 282, 4649, 314])),
    Case("cmpl_token_prompt_echo", C, _cmp(prompt=[504, 3575, 282, 4649, 314], echo=True)),
    Case("cmpl_prompt_list", C, _cmp(prompt=[PROMPT, "Hello"])),
    Case("cmpl_logit_bias", C, _cmp(logit_bias={"7042": 100})),
    Case("cmpl_logit_bias_neg", C, _cmp(logit_bias={"7042": -100}, logprobs=1)),
    Case("cmpl_allowed", C, _cmp(allowed_token_ids=[30, 33, 216])),
    Case("cmpl_allowed_logprobs", C, _cmp(allowed_token_ids=[30, 33, 216], logprobs=2)),
    Case("cmpl_bad_words", C, _cmp(bad_words=[" Paris"])),
    Case("cmpl_bad_words_multi", C, _cmp(max_tokens=16, bad_words=["The answer"])),
    Case("cmpl_rep_pen", C, _cmp(max_tokens=24, repetition_penalty=1.5)),
    Case("cmpl_freq_pen", C, _cmp(max_tokens=24, frequency_penalty=1.5)),
    Case("cmpl_pres_pen", C, _cmp(max_tokens=24, presence_penalty=1.5)),
    Case("cmpl_neg_pen", C, _cmp(max_tokens=24, presence_penalty=-1.0)),
    Case("cmpl_return_ids", C, _cmp(return_token_ids=True)),
    Case("cmpl_as_token_ids", C, _cmp(logprobs=1, return_tokens_as_token_ids=True)),
    Case("cmpl_best_of", C, _cmp(best_of=2, n=1)),
    Case("cmpl_best_of_n", C, _cmp(best_of=2, n=2, temperature=1.0, top_k=1)),
    Case("cmpl_seed", C, _cmp(temperature=1.0, seed=7)),
    Case("cmpl_stream", C, _cmp(stream=True), stream=True),
    Case("cmpl_stream_usage", C, _cmp(stream=True, n=2, temperature=1.0, top_k=1, logprobs=1,
                                      stream_options=USAGE), stream=True),
    Case("cmpl_stream_echo", C, _cmp(stream=True, echo=True), stream=True),
    Case("cmpl_stream_echo_lp", C, _cmp(stream=True, echo=True, logprobs=1), stream=True),
    Case("cmpl_stream_stop", C, _cmp(stream=True, max_tokens=16, stop=["answer"],
                                     include_stop_str_in_output=True), stream=True),
    Case("cmpl_stream_ids", C, _cmp(stream=True, return_token_ids=True), stream=True),
    Case("cmpl_stream_cont_usage", C, _cmp(stream=True, max_tokens=3, stream_options={
        "include_usage": True, "continuous_usage_stats": True}), stream=True),
    Case("cmpl_stream_list", C, _cmp(stream=True, prompt=[PROMPT, "Hello"],
                                     stream_options=USAGE), stream=True),
    Case("cmpl_multibyte", C, _cmp(prompt="My favourite emoji is \U0001F600 and \u65e5\u672c",
                                   max_tokens=3, echo=True, logprobs=1)),
    Case("cmpl_multibyte_stream", C, _cmp(prompt="Say \u65e5\u672c twice:", stream=True,
                                          logprobs=1), stream=True),
    Case("chat_multibyte", CH, _chat(messages=[{"role": "user", "content":
                                               "Say \u65e5\u672c twice"}],
                                     logprobs=True, top_logprobs=1)),
    Case("cmpl_choice", C, _cmp(structured_outputs={"choice": ["yes", "no", "maybe"]})),
    Case("cmpl_regex", C, _cmp(structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})),
    Case("cmpl_echo_list_lp", C, _cmp(prompt=[PROMPT, "Hello"], echo=True, logprobs=1,
                                      max_tokens=3)),
    Case("cmpl_prompt_lp_ids", C, _cmp(prompt=[504, 3575, 282, 4649, 314], prompt_logprobs=1,
                                       max_tokens=2)),
    Case("cmpl_stop_special", C, {"prompt": SPECIAL, "max_tokens": 30, "temperature": 0,
                                  "skip_special_tokens": False, "ignore_eos": True,
                                  "stop": ["<|im_end|>"], "include_stop_str_in_output": True}),
    Case("cmpl_stream_min_tokens", C, _cmp(prompt="Say hi.<|im_end|>", max_tokens=6,
                                           min_tokens=4, stream=True), stream=True),
    Case("chat_json_object", CH, _chat(response_format={"type": "json_object"}, max_tokens=24)),
    Case("chat_json_schema", CH, _chat(max_tokens=24, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": {
            "type": "object", "properties": {"colour": {"type": "string"}},
            "required": ["colour"]}}})),
    Case("chat_tools_none", CH, _chat(tools=[TOOL], tool_choice="none")),
    Case("chat_tool_required", CH, _chat(tools=[TOOL], tool_choice="required", max_tokens=40)),
    Case("chat_tool_named", CH, _chat(tools=[TOOL], max_tokens=40, tool_choice={
        "type": "function", "function": {"name": "get_colour"}})),
    Case("chat_tool_required_stream", CH, _chat(tools=[TOOL], tool_choice="required",
                                                max_tokens=40, stream=True), stream=True),
    Case("chat_stop_ids_incl", CH, _chat(max_tokens=16, stop_token_ids=[28],
                                         include_stop_str_in_output=True)),
    Case("responses", "/v1/responses", {"input": "Name three colours.", "max_output_tokens": 8,
                                        "temperature": 0}),
    Case("err_tool_required_no_tools", CH, _chat(tool_choice="required")),
    Case("err_response_format", CH, _chat(response_format={"type": "yaml"})),
    Case("chat_greedy", CH, _chat()),
    Case("chat_logprobs", CH, _chat(logprobs=True, top_logprobs=3)),
    Case("chat_logprobs_only", CH, _chat(logprobs=True)),
    Case("chat_n2", CH, _chat(n=2, temperature=1.0, top_k=1)),
    Case("chat_no_gen_prompt", CH, _chat(add_generation_prompt=False)),
    Case("chat_continue", CH, _chat(messages=CONT, add_generation_prompt=False,
                                    continue_final_message=True)),
    Case("chat_echo", CH, _chat(messages=CONT, add_generation_prompt=False,
                                continue_final_message=True, echo=True)),
    Case("chat_echo_gen", CH, _chat(echo=True)),
    Case("chat_template_kwargs", CH, _chat(chat_template_kwargs={"foo": 1})),
    Case("chat_template_kwargs_agp", CH, _chat(chat_template_kwargs={
        "add_generation_prompt": False})),
    Case("chat_documents", CH, _chat(documents=[{"title": "t", "text": "Paris"}])),
    Case("chat_max_completion", CH, {"messages": CHAT, "max_completion_tokens": 5,
                                     "temperature": 0}),
    Case("chat_stop", CH, _chat(max_tokens=16, stop=[","], include_stop_str_in_output=True)),
    Case("chat_prompt_logprobs", CH, _chat(prompt_logprobs=1)),
    Case("chat_return_ids", CH, _chat(return_token_ids=True)),
    Case("chat_prompt_text", CH, _chat(return_prompt_text=True)),
    Case("chat_stream_prompt_text", CH, _chat(return_prompt_text=True, stream=True),
         stream=True),
    Case("chat_special", CH, _chat(skip_special_tokens=False, max_tokens=40)),
    Case("chat_add_special", CH, _chat(add_special_tokens=True)),
    Case("chat_truncate", CH, _chat(truncate_prompt_tokens=5)),
    Case("chat_system", CH, _chat(messages=[{"role": "system", "content": "Be brief."}, *CHAT])),
    Case("chat_content_parts", CH, _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]}])),
    Case("chat_developer", CH, _chat(messages=[{"role": "developer", "content": "Be brief."},
                                              *CHAT])),
    Case("chat_name", CH, _chat(messages=[{"role": "user", "content": "Hi", "name": "bob"}])),
    Case("chat_multi_turn", CH, _chat(messages=[*CONT, {"role": "user", "content": "More."}])),
    Case("chat_tool_history", CH, _chat(tools=[TOOL], tool_choice="none", messages=[
        *CHAT, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_colour", "arguments": "{\"n\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "red"}])),
    Case("tokenize_tool_history", "/tokenize", {"messages": [
        *CHAT, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_colour", "arguments": "{\"n\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "red"}],
        "add_generation_prompt": True}),
    Case("chat_stream", CH, _chat(stream=True), stream=True),
    Case("chat_stream_usage", CH, _chat(stream=True, n=2, temperature=1.0, top_k=1,
                                        logprobs=True, top_logprobs=1, stream_options=USAGE),
         stream=True),
    Case("chat_stream_echo", CH, _chat(stream=True, messages=CONT,
                                       add_generation_prompt=False,
                                       continue_final_message=True, echo=True), stream=True),
    Case("chat_stream_stop", CH, _chat(stream=True, max_tokens=16, stop=[","],
                                       stream_options=USAGE), stream=True),
    Case("chat_stream_ids", CH, _chat(stream=True, return_token_ids=True), stream=True),
    Case("tokenize", "/tokenize", {"prompt": PROMPT}),
    Case("tokenize_strs", "/tokenize", {"prompt": PROMPT, "return_token_strs": True,
                                        "add_special_tokens": False}),
    Case("tokenize_chat", "/tokenize", {"messages": CHAT, "add_generation_prompt": True}),
    Case("tokenize_chat_continue", "/tokenize", {"messages": CONT,
                                                 "add_generation_prompt": False,
                                                 "continue_final_message": True}),
    Case("detokenize", "/detokenize", {"tokens": [504, 3575, 282, 4649, 314]}),
    Case("detokenize_special", "/detokenize", {"tokens": [1, 504, 2, 198]}),
    Case("edge_top_p0", C, _cmp(top_p=0)),
    Case("edge_top_k0", C, _cmp(top_k=0, temperature=1.0, seed=1, max_tokens=1, logprobs=1)),
    Case("edge_tiny_temp_n2", C, _cmp(temperature=1e-6, n=2)),
    Case("edge_max_model_len", C, _cmp(max_tokens=8192, prompt="Hi<|im_end|>")),
    Case("edge_truncate_long", C, _cmp(truncate_prompt_tokens=50)),
    Case("edge_truncate0", C, _cmp(truncate_prompt_tokens=0)),
    Case("edge_stop_empty", C, _cmp(stop=[""])),
    Case("edge_stop_str", C, _cmp(stop=".", max_tokens=16)),
    Case("edge_top_logprobs0", CH, _chat(logprobs=True, top_logprobs=0)),
    Case("edge_logprobs20", C, _cmp(logprobs=20, max_tokens=2)),
    Case("edge_logit_bias_float", C, _cmp(logit_bias={"7042": -0.5}, logprobs=1, max_tokens=2)),
    Case("edge_min_tokens_eq", C, _cmp(min_tokens=8)),
    Case("edge_stop_ids_eos", C, _cmp(prompt="Say hi.<|im_end|>", stop_token_ids=[2],
                                      max_tokens=6)),
    # vLLM 0.32's per-request fields (session 49)
    Case("cmpl_logprob_token_ids", C, _cmp(logprobs=1, logprob_token_ids=[30, 33, 216])),
    Case("chat_logprob_token_ids", CH, _chat(logprobs=True, logprob_token_ids=[30, 33, 216])),
    Case("cmpl_stream_interval", C, _cmp(stream=True, max_tokens=10, stream_interval=3,
                                         return_token_ids=True), stream=True),
    Case("chat_stream_interval", CH, _chat(stream=True, max_tokens=10, stream_interval=4),
         stream=True),
    Case("cmpl_repetition", C, _cmp(max_tokens=48, ignore_eos=True, repetition_detection={
        "max_pattern_size": 8, "min_count": 2})),
    Case("chat_repetition", CH, _chat(max_tokens=48, ignore_eos=True, repetition_detection={
        "max_pattern_size": 8, "min_count": 2})),
    Case("err_logprob_token_ids", C, _cmp(logprob_token_ids=[30])),
    Case("err_repetition_count", C, _cmp(repetition_detection={"max_pattern_size": 2,
                                                               "min_count": 1})),
    Case("err_stream_bad", C, _cmp(stream=True, temperature=-1), stream=True),
    Case("err_chat_stream_bad", CH, _chat(stream=True, n=0), stream=True),
    Case("err_no_prompt", C, {"max_tokens": 4}),
    Case("err_empty_prompt", C, _cmp(prompt="")),
    Case("err_empty_ids", C, _cmp(prompt=[])),
    Case("err_bad_type", C, _cmp(max_tokens="x")),
    Case("err_neg_max", C, _cmp(max_tokens=-1)),
    Case("err_temp", C, _cmp(temperature=-1)),
    Case("err_top_p", C, _cmp(top_p=1.5)),
    Case("err_top_k", C, _cmp(top_k=-5)),
    Case("err_min_p", C, _cmp(min_p=2)),
    Case("err_rep_pen", C, _cmp(repetition_penalty=0)),
    Case("err_pres_pen", C, _cmp(presence_penalty=3)),
    Case("err_n0", C, _cmp(n=0)),
    Case("err_logprobs_big", C, _cmp(logprobs=50)),
    Case("err_logprobs_neg", C, _cmp(logprobs=-2)),
    Case("err_too_long", C, _cmp(max_tokens=10 ** 7)),
    Case("err_min_gt_max", C, _cmp(min_tokens=9, max_tokens=3)),
    Case("err_model", C, _cmp(model="nope")),
    Case("err_bad_token", C, _cmp(prompt=[10 ** 7])),
    Case("err_logit_bias_id", C, _cmp(logit_bias={"99999999": 1})),
    Case("err_allowed_bad", C, _cmp(allowed_token_ids=[10 ** 7])),
    Case("err_allowed_empty", C, _cmp(allowed_token_ids=[])),
    Case("err_stop_ids_bad", C, _cmp(stop_token_ids=[10 ** 7])),
    Case("err_seed_float", C, _cmp(seed=1.5)),
    Case("err_unknown_field", C, _cmp(foo=1)),
    Case("err_stream_usage_no_stream", C, _cmp(stream_options={"include_usage": True})),
    Case("err_chat_empty", CH, _chat(messages=[])),
    Case("err_chat_no_messages", CH, {"max_tokens": 4}),
    Case("err_chat_role", CH, _chat(messages=[{"role": "wizard", "content": "x"}])),
    Case("err_chat_top_logprobs", CH, _chat(top_logprobs=3)),
    Case("err_chat_top_logprobs_big", CH, _chat(logprobs=True, top_logprobs=50)),
    Case("err_chat_continue_both", CH, _chat(add_generation_prompt=True,
                                             continue_final_message=True)),
    Case("err_chat_stream_prompt_lp", CH, _chat(stream=True, prompt_logprobs=1), stream=True),
    Case("err_chat_n2_greedy", CH, _chat(n=2)),
    Case("err_json", C, {"__raw__": "{not json"}),
    Case("err_json_array", C, {"__raw__": "[1, 2]"}),
    Case("err_detok_bad", "/detokenize", {"tokens": [10 ** 7]}),
    Case("err_tokenize_both", "/tokenize", {"prompt": "x", "messages": CHAT}),
    Case("err_404", "/v1/nothing"),
    Case("err_405", "/v1/completions"),
]


def _post(client: httpx.Client, url: str, case: Case) -> tuple[int, Any, list[str]]:
    """(status, JSON body or list of SSE event objects, raw SSE lines)."""
    if case.body is None:
        r = client.get(url + case.path)
        return r.status_code, _json(r.text), []
    if "__raw__" in case.body:
        r = client.post(url + case.path, content=case.body["__raw__"],
                        headers={"content-type": "application/json"})
        return r.status_code, _json(r.text), []
    body = {"model": MODEL[url], **case.body} if case.path.startswith("/v1/") else case.body
    if not case.stream:
        r = client.post(url + case.path, json=body)
        return r.status_code, _json(r.text), []
    with client.stream("POST", url + case.path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, _json(r.read().decode()), []
        text = r.read().decode()
    lines = text.split("\n")
    events = [_json(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]
    return r.status_code, events, lines


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {"<not json>": text[:200]}


MODEL: dict[str, str] = {}
NULL = "~null "  # a field null on one side and absent on the other
STYLE = "~style "  # an error type/code in each server's own vocabulary


def diff(a: Any, b: Any, where: str, out: list[str], tol: float) -> None:
    """Append to ``out`` a line per difference between kvflow's ``a`` and vLLM's ``b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in IGNORED:
                continue
            w = f"{where}.{k}"
            if k not in b:
                out.append(f"{NULL if a[k] is None else ''}{w}: only kvflow ({_short(a[k])})")
            elif k not in a:
                out.append(f"{NULL if b[k] is None else ''}{w}: only vllm ({_short(b[k])})")
            elif k == "id" and isinstance(a[k], str) and isinstance(b[k], str):
                pa, pb = a[k].split("-")[0], b[k].split("-")[0]
                if pa != pb:
                    out.append(f"{w}: id prefix kvflow {pa!r} vllm {pb!r}")
            elif k == "message" and where.endswith("error"):
                continue  # messages are printed with --messages, not compared
            elif k in ("type", "code") and where.endswith("error") and _vllm_style(k, b[k]):
                if a[k] != b[k]:
                    out.append(f"{STYLE}{w}: kvflow {_short(a[k])} vllm {_short(b[k])}")
            else:
                diff(a[k], b[k], w, out, tol)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{where}: length kvflow {len(a)} vllm {len(b)}: "
                       f"kvflow {_short(a)} vllm {_short(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, f"{where}[{i}]", out, tol)
        return
    if a is None or b is None:
        if a is not b:
            out.append(f"{where}: kvflow {_short(a)} vllm {_short(b)}")
        return
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str):
        if type(a) is not type(b) or a != b:
            out.append(f"{where}: kvflow {_short(a)} vllm {_short(b)}")
        return
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if type(a) is not type(b) and not _logprob(where):
            out.append(f"{where}: type kvflow {type(a).__name__} vllm {type(b).__name__}")
        bound = tol if _logprob(where) else 0.0
        if abs(a - b) > bound and not (a < -1e4 and b < -1e4):
            out.append(f"{where}: kvflow {a!r} vllm {b!r}")
        return
    out.append(f"{where}: type kvflow {type(a).__name__} vllm {type(b).__name__}")


def _vllm_style(key: str, value: Any) -> bool:
    """vLLM's own error vocabulary: ``code`` the HTTP status as an integer, ``type`` an
    exception class or status phrase (``BadRequestError``, ``Bad Request``)."""
    return isinstance(value, int) if key == "code" else (
        isinstance(value, str) and "_" not in value and value[:1].isupper())


def _logprob(where: str) -> bool:
    return "logprob" in where.lower()


def _short(x: Any) -> str:
    s = json.dumps(x, ensure_ascii=False)
    return s if len(s) <= 120 else s[:117] + "..."


def fold_stream(events: list[Any]) -> dict[str, Any]:
    """The parts of a stream that are compared: choice 0's first chunk (the role chunk in
    chat), each choice's concatenated text and tokens and its finish chunk, the usage chunk.
    How many chunks carry a choice's tokens is not compared: a server behind its engine
    sends several tokens in one chunk."""
    choices: dict[int, dict[str, Any]] = {}
    usage_chunks = [e for e in events if isinstance(e, dict) and not e.get("choices")]
    for e in events:
        for c in e.get("choices") or [] if isinstance(e, dict) else []:
            acc = choices.setdefault(c.get("index", -1), {"text": "", "tokens": []})
            delta = c.get("delta") or {}
            acc["text"] += c.get("text") or delta.get("content") or ""
            lp = c.get("logprobs") or {}
            acc["tokens"] += lp.get("tokens") or [x.get("token") for x in
                                                  lp.get("content") or []]
            if c.get("finish_reason") is not None:
                acc["finish_chunk"] = c
    first = next((e for e in events if isinstance(e, dict) and
                  any(c.get("index") == 0 for c in e.get("choices") or [])), None)
    return {"first": first,
            "choices": {str(k): v for k, v in sorted(choices.items())},
            "usage_chunks": usage_chunks}


def framing(lines: list[str]) -> list[str]:
    """What is wrong with an SSE body's framing (empty when it is well formed)."""
    bad = [f"line {i}: {ln[:60]!r}" for i, ln in enumerate(lines)
           if ln and not ln.startswith("data: ")]
    events = [ln for ln in lines if ln]
    if not events or events[-1] != "data: [DONE]":
        bad.append("no final data: [DONE]")
    if re.search(r"data: [^\n]*\ndata: ", "\n".join(lines)):
        bad.append("events not separated by a blank line")
    return bad


def run_case(client: httpx.Client, kv: str, vl: str, case: Case, tol: float,
             messages: bool) -> list[str]:
    """The differences of one case, one line each."""
    sa, a, la = _post(client, kv, case)
    sb, b, lb = _post(client, vl, case)
    out: list[str] = []
    if sa != sb:
        out.append(f"status: kvflow {sa} vllm {sb}")
    if messages or sa != sb:
        for who, body in (("kvflow", a), ("vllm", b)):
            err = body.get("error") if isinstance(body, dict) else None
            if isinstance(err, dict) or (isinstance(body, dict) and "detail" in body):
                out.append(f"  {who} says: {_short(err or body)}")
    if case.stream and sa == sb == 200:
        for who, lines in (("kvflow", la), ("vllm", lb)):
            out += [f"sse framing {who}: {x}" for x in framing(lines)]
        a, b = fold_stream(a), fold_stream(b)
    diff(a, b, "", out, tol)
    if sa == sb == 200 and any(".text:" in x or ".content:" in x for x in out):
        out += tie_note(client, kv, vl, case)
    return out


def _top2(client: httpx.Client, url: str, case: Case) -> list[list[tuple[str, float]]]:
    """Per generated token of choice 0: [(chosen token, logprob), (top-2 entries...)]."""
    body = {k: v for k, v in case.body.items() if k not in ("stream", "stream_options", "echo")}
    body = {"model": MODEL[url], **body, "n": 1}
    chat = case.path == CH
    body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    data = client.post(url + case.path, json=body).json()
    lp = (data.get("choices") or [{}])[0].get("logprobs") or {}
    if chat:
        return [[(e["token"], e["logprob"])] + [(t["token"], t["logprob"])
                                                for t in e["top_logprobs"]]
                for e in lp.get("content") or []]
    return [[(t, x)] + sorted(top.items(), key=lambda kv: -kv[1])
            for t, x, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [],
                                 lp.get("top_logprobs") or [])]


def tie_note(client: httpx.Client, kv: str, vl: str, case: Case) -> list[str]:
    """Where greedy texts part: both servers' top-2 at the first token that differs (a gap
    under ``--tie`` on either side is a near-tie, not a defect)."""
    a, b = _top2(client, kv, case), _top2(client, vl, case)
    for i, (x, y) in enumerate(zip(a, b)):
        if x[0][0] != y[0][0]:
            gaps = [e[1][1] - e[2][1] if len(e) > 2 else float("inf") for e in (x, y)]
            kind = "near-tie" if min(gaps) < TIE[0] else "NOT a near-tie"
            return [f"first differing token {i}: {kind}: kvflow {_short(x)} vllm {_short(y)}"]
    return []


TIE = [0.1]


def main(argv: list[str] | None = None) -> int:
    """Run the cases and print the differences; exit status 0 (2: a server did not answer)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvflow", required=True, help="kvflow serve's base URL")
    ap.add_argument("--vllm", required=True, help="vLLM's base URL")
    ap.add_argument("-k", default="", help="run only the cases whose name contains this")
    ap.add_argument("--tol", type=float, default=0.05, help="logprob tolerance")
    ap.add_argument("--tie", type=float, default=0.1,
                    help="top-2 gap under which a greedy divergence is a near-tie")
    ap.add_argument("--messages", action="store_true", help="print every error message")
    ap.add_argument("--nulls", action="store_true",
                    help="list fields null on one side and absent on the other")
    ap.add_argument("--style", action="store_true",
                    help="list error type/code differences in each server's vocabulary")
    args = ap.parse_args(argv)
    TIE[0] = args.tie
    with httpx.Client(timeout=120) as client:
        for url in (args.kvflow, args.vllm):
            try:
                MODEL[url] = client.get(url + "/v1/models").json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, LookupError) as e:
                print(f"{url}/v1/models did not answer with a model ({e}): start the server "
                      "first (see this script's docstring)", file=sys.stderr)
                return 2
        for case in CASES:
            if args.k not in case.name:
                continue
            lines = run_case(client, args.kvflow, args.vllm, case, args.tol, args.messages)
            shown = [x for x in lines if args.nulls or not x.startswith(NULL)]
            shown = [x for x in shown if args.style or not x.startswith(STYLE)]
            hidden = len(lines) - len(shown)
            print(f"== {case.name}: " + ("same" if not lines else f"{len(lines)} differences")
                  + (f" ({hidden} null/absent or error-vocabulary ones not shown)"
                     if hidden else ""))
            for ln in shown:
                print("   " + ln)
    return 0


if __name__ == "__main__":
    sys.exit(main())
