"""Every field of every request model (kvflow/entrypoints/protocol/) is honoured or rejected.

``CASES`` holds, per endpoint, one check per declared field; ``test_every_field_has_a_case``
fails when a field is added without one. A "used" check sends a value and asserts its effect
against a baseline request or an independent oracle (the tokenizer, the Jinja template); a
"rejected" check asserts a 400 (404 for ``model``) whose ``param`` names the field. Also:
text with a lone UTF-16 surrogate in any string of any body is a 400 naming that string's path
(unknown top-level fields: tests/e2e/test_unknown_fields_served.py). The server runs the tiny Llama
with a tokenizer that adds ``<bos>`` (so ``add_special_tokens`` shows), ``--policy priority``
and admission control with a 60 s TTFT target (so ``target_ttft_ms`` shows; every ordinary
request is admitted).
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvflow.engine.logprob_tokens import LogprobTokenTexts
from kvflow.entrypoints import protocol
from tests.conftest import TINY_CHAT_TEMPLATE
from tests.e2e.conftest import RUNTIME_LORA_ENV, post_at_once, ready_side_by_side
from tests.lora.adapters import make_adapter
from tests.models.embedding_models import build_decoder

ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256", "--block-size", "4",
        "--policy", "priority", "--max-num-seqs", "4", "--uvicorn-log-level", "info",
        "--target-ttft-ms", "60000", "--admission-control", "--enable-lora", "--max-lora-rank",
        "8", "--trust-request-chat-template"]
C, CH, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
EMB = "/v1/embeddings"
R = "/v1/responses"
PROMPT = "the quick brown fox"
HI = [{"role": "user", "content": "hi"}]
BASE = {C: {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True},
        CH: {"messages": HI, "max_tokens": 8, "temperature": 0, "return_token_ids": True},
        TOK: {"prompt": PROMPT}, DETOK: {"tokens": [5, 6, 7]},
        LOAD: {"lora_name": "base-lora"}, UNLOAD: {}, EMB: {"input": PROMPT},
        R: {"input": "hi", "max_output_tokens": 8, "temperature": 0}}
HOT = {"temperature": 5.0, "seed": 0, "max_tokens": 16}  # sampling far from greedy


EMBED_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
              "--uvicorn-log-level", "info", "--chat-template", TINY_CHAT_TEMPLATE,
              "--trust-request-chat-template"]


def _add_bos(folder: str) -> None:
    """Make the tokenizer saved in ``folder`` put ``<bos>`` before every text it encodes
    with special tokens (so ``add_special_tokens`` shows)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    tok.save_pretrained(folder)


def _model_dir(tiny_chat_model, built_models) -> str:
    def build(folder: str) -> None:
        shutil.copytree(tiny_chat_model, folder)
        _add_bos(folder)

    return built_models("fields", build)[0]


EMBED_PROMPT = "Query: "  # the embedding model's default prompt (and it lower-cases text)


def _embed_model(tiny_tokenizer, built_models) -> str:
    """A tiny decoder embedding model whose sentence-transformers config lower-cases text and
    puts ``EMBED_PROMPT`` before each, its tokenizer adding ``<bos>``."""
    def build(folder: str) -> None:
        build_decoder(tiny_tokenizer, folder, "lasttoken")
        _add_bos(folder)
        for name, changes in (("sentence_bert_config.json", {"do_lower_case": True}),
                              ("config_sentence_transformers.json", {
                                  "prompts": {"query": EMBED_PROMPT, "document": ""},
                                  "default_prompt_name": "query"})):
            with open(f"{folder}/{name}") as f:
                config = json.load(f)
            with open(f"{folder}/{name}", "w") as f:
                json.dump({**config, **changes}, f)

    return built_models("embed", build)[0]


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    built = fixture("built_models")
    return [(_model_dir(fixture("tiny_chat_model"), built), ARGS, RUNTIME_LORA_ENV),
            (_embed_model(fixture("tiny_tokenizer"), built), EMBED_ARGS, None)]


@pytest.fixture(scope="module")
def model_dir(tiny_chat_model, built_models) -> str:
    """The tiny chat model, its tokenizer adding <bos> when add_special_tokens is set."""
    return _model_dir(tiny_chat_model, built_models)


@pytest.fixture(scope="module")
def servers(start_server, request, model_dir, tmp_path_factory):
    """(server, embed_server), started side by side: the chat model's (with a LoRA adapter
    made while it starts, ``server.lora_path``) and a tiny Matryoshka-capable decoder
    embedding model's (last-token pooling, normalized)."""
    server = start_server.declared(request, 0, wait=False)
    embed_server = start_server.declared(request, 1, wait=False)
    # the adapter is made while both servers start (start_server stops them at the session's
    # end should this raise)
    server.lora_path = make_adapter(model_dir, str(tmp_path_factory.mktemp("lora") / "a"),
                                    5, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    with ready_side_by_side(server, embed_server):
        yield server, embed_server


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def embed_server(servers):
    return servers[1]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def post(server, path: str, body: dict[str, Any], base: bool = True) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={**BASE[path], **body} if base else body,
                      timeout=60)


def ok(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def rejected(path: str, value: dict[str, Any], param: str, status: int = 400) -> Callable:
    def check(server, tokenizer) -> None:
        resp = post(server, path, value)
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["param"] == param, resp.text
    return check


def ids(resp: dict[str, Any], i: int = 0) -> list[int]:
    return resp["choices"][i]["token_ids"]


def text(resp: dict[str, Any], i: int = 0) -> str:
    choice = resp["choices"][i]
    return choice["text"] if "text" in choice else choice["message"]["content"]


# ---- sampling fields (both endpoints) --------------------------------------------------------
def sampling_cases(path: str) -> dict[str, Callable]:
    def greedy(server):
        return ids(ok(server, path, {"max_tokens": 16}))

    def hot_differs_and_filter_restores(field: str, value: Any) -> Callable:
        def check(server, tokenizer):
            assert ids(ok(server, path, HOT)) != greedy(server)
            assert ids(ok(server, path, {**HOT, field: value})) == greedy(server)
        return check

    def seed(server, tokenizer):
        a, b = (ids(ok(server, path, {**HOT, "seed": s})) for s in (0, 1))
        assert a != b and a == ids(ok(server, path, HOT))

    def temperature(server, tokenizer):
        assert ids(ok(server, path, HOT)) != greedy(server)

    def n(server, tokenizer):
        resp = ok(server, path, {**HOT, "n": 2})
        assert len(resp["choices"]) == 2 and ids(resp, 0) != ids(resp, 1)

    forced = {"max_tokens": 16, "guided_regex": "the quick brown fox jumps"}  # known text

    def stop(server, tokenizer):
        out = ok(server, path, {**forced, "stop": ["brown"]})
        assert (text(out), out["choices"][0]["finish_reason"]) == ("the quick ", "stop")

    def include_stop(server, tokenizer):
        out = ok(server, path, {**forced, "stop": "brown", "include_stop_str_in_output": True})
        assert text(out) == "the quick brown"

    def stop_token_ids(server, tokenizer):
        greedy_ids = ids(ok(server, path, {}))
        third = greedy_ids[2]
        out = ok(server, path, {"stop_token_ids": [third]})["choices"][0]
        assert (out["finish_reason"], out["stop_reason"], out["token_ids"]) == \
            ("stop", third, greedy_ids[:greedy_ids.index(third) + 1])

    eos_bias = {"logit_bias": {str(0): 100}}  # <eos> is id 0

    def logit_bias(server, tokenizer):
        assert ids(ok(server, path, {"logit_bias": {"7": 100}}))[:3] == [7, 7, 7]

    def ignore_eos(server, tokenizer):
        assert ids(ok(server, path, eos_bias)) == [0]
        assert ids(ok(server, path, {**eos_bias, "ignore_eos": True})) == [0] * 8

    def min_tokens(server, tokenizer):
        out = ids(ok(server, path, {**eos_bias, "min_tokens": 3}))
        assert len(out) == 4 and out[-1] == 0 and 0 not in out[:3]

    def skip_special_tokens(server, tokenizer):
        body = {**eos_bias, "ignore_eos": True, "max_tokens": 2}
        assert text(ok(server, path, body)) == ""
        assert text(ok(server, path, {**body, "skip_special_tokens": False})) == "<eos><eos>"

    def spaces_between_special_tokens(server, tokenizer):
        """Taken (it was a 400); the tiny byte-level tokenizer writes nothing between two
        special tokens, so the text is the same (vLLM's rule; the WordPiece case, where it
        differs: tests/test_detokenizer.py)."""
        body = {**eos_bias, "ignore_eos": True, "max_tokens": 2, "skip_special_tokens": False}
        assert text(ok(server, path, {**body, "spaces_between_special_tokens": False})) == \
            "<eos><eos>"

    def penalty(field: str, value: float) -> Callable:
        def check(server, tokenizer):
            plain = ids(ok(server, path, {"max_tokens": 32}))
            assert len(set(plain)) < len(plain)  # the greedy output repeats tokens
            assert ids(ok(server, path, {"max_tokens": 32, field: value})) != plain
        return check

    def user(server, tokenizer):
        ok(server, path, {"user": "user-7f3a"})
        assert "user 'user-7f3a'" in server.log()

    def stream(server, tokenizer):
        resp = post(server, path, {"stream": True})
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.text.rstrip().endswith("data: [DONE]")

    def stream_options(server, tokenizer):
        body = {"stream": True, "stream_options": {"include_usage": True}}
        events = [json.loads(line[6:]) for line in post(server, path, body).text.splitlines()
                  if line.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 8

    def return_token_ids(server, tokenizer):
        assert "token_ids" not in ok(server, path, {"return_token_ids": False})["choices"][0]

    def constraint(body: dict[str, Any], accept: Callable[[str], bool]) -> Callable:
        def check(server, tokenizer):
            out = ok(server, path, {**HOT, "max_tokens": 24, **body})
            assert accept(text(out)), text(out)
        return check

    choice = constraint({"structured_outputs": {"choice": ["yes", "no"]}},
                        lambda t: t in ("yes", "no"))

    def priority(server, tokenizer):
        """Accepted under --policy priority and passed to the engine (the same greedy text at
        any priority; a value that is not an integer is a 400 naming the field). The queue
        order it gives is deterministic only inside the engine, so it is asserted there:
        tests/test_chat_template.py::test_generate_priority_orders_the_queue (LLM.generate)
        and the scheduler tests; over HTTP it would be a wall-clock race on a tiny model."""
        base = text(ok(server, path, {"max_tokens": 6}))
        for prio in (-9, 9):
            assert text(ok(server, path, {"priority": prio, "max_tokens": 6})) == base
        rejected(path, {"priority": "high"}, "priority")(server, tokenizer)

    def warm(server):
        """Enough measured steps (>= 16) for the step-time model to predict."""
        for _ in range(3):
            ok(server, path, {"max_tokens": 8, "ignore_eos": True})

    def target_ttft_ms(server, tokenizer):
        """Admission control (60 s server default) honours the request's own target: one no
        step can meet (1 us) is refused with 503 + Retry-After once the model predicts and
        the engine is busy (of six sent at once; an idle engine admits every request); a
        generous one is served; 0 is a 400 naming the field."""
        warm(server)
        burst = post_at_once(f"{server.url}{path}", {**BASE[path], "max_tokens": 100,
                                                     "ignore_eos": True,
                                                     "target_ttft_ms": 0.001}, 6)
        assert {r.status_code for r in burst} <= {200, 503}, [r.text for r in burst]
        resp = next(r for r in burst if r.status_code == 503)
        assert resp.json()["error"]["code"] == "ttft_unattainable"
        assert int(resp.headers["retry-after"]) >= 1
        assert ids(ok(server, path, {"target_ttft_ms": 60000.0})) == ids(ok(server, path, {}))
        rejected(path, {"target_ttft_ms": 0}, "target_ttft_ms")(server, tokenizer)

    def target_tpot_ms(server, tokenizer):
        """Accepted and passed to the engine (the same greedy tokens with a target no step can
        meet, 1 us, which then no longer limits the batch, and with a generous one); 0 is a
        400 naming the field. What the target does to the batch is timing: it is asserted on
        a fake clock, per request, in tests/core/test_slo_scheduling.py
        (test_per_request_tpot_target_is_honoured) and tests/core/test_slo_feedback.py; over
        HTTP on a shared CPU it would be a wall-clock race."""
        warm(server)
        base = ids(ok(server, path, {"max_tokens": 8, "ignore_eos": True}))
        for tpot in (0.001, 60000.0):
            body = {"max_tokens": 8, "ignore_eos": True, "target_tpot_ms": tpot}
            assert ids(ok(server, path, body)) == base
        rejected(path, {"target_tpot_ms": 0}, "target_tpot_ms")(server, tokenizer)

    def request_id(server, tokenizer):
        """vLLM's request_id names the reply (``cmpl-`` / ``chatcmpl-`` + it), streamed
        chunks too; two requests sending the same id at once are still two requests (the
        engine's ids stay unique), each with the greedy reply; without it the id is random."""
        prefix = "chatcmpl" if path == CH else "cmpl"
        body = {**BASE[path], "max_tokens": 16, "request_id": "trace-42"}
        for resp in post_at_once(f"{server.url}{path}", body, 2):
            assert resp.status_code == 200, resp.text
            assert resp.json()["id"] == f"{prefix}-trace-42"
            assert ids(resp.json()) == greedy(server)
        chunks = post(server, path, {"request_id": "trace-42", "stream": True}).text
        events = [json.loads(line[6:]) for line in chunks.splitlines()
                  if line.startswith("data: {")]
        assert events and {e["id"] for e in events} == {f"{prefix}-trace-42"}
        assert re.fullmatch(f"{prefix}-[0-9a-f]{{32}}", ok(server, path, {})["id"])
        rejected(path, {"request_id": ""}, "request_id")(server, tokenizer)
        # vLLM's X-Request-Id header names it too, before the body's field
        headed = httpx.post(f"{server.url}{path}", json={**BASE[path], "max_tokens": 2,
                                                         "request_id": "trace-42"},
                            headers={"X-Request-Id": "gw-7"}, timeout=60)
        assert headed.status_code == 200 and headed.json()["id"] == f"{prefix}-gw-7"

    def prompt_logprobs(server, tokenizer):
        """Chat (vLLM's field on the reply): one entry per rendered prompt token, None
        first, each holding the prompt's token and the top 2, logprobs equal to
        transformers' log-softmax over the same ids; streamed chat refuses it (vLLM's rule).
        Completions: per choice, checked in ``completion_cases``."""
        import torch
        from transformers import AutoModelForCausalLM

        reply = ok(server, path, {"prompt_logprobs": 2, "max_tokens": 1})
        ids = reply["prompt_token_ids"]
        entries = reply["prompt_logprobs"]
        model = AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path,
                                                     dtype=torch.float32).eval()
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        assert len(entries) == len(ids) and entries[0] is None
        for pos in range(1, len(ids)):
            top2 = ref[pos - 1].topk(2).indices.tolist()
            assert set(entries[pos]) == {str(t) for t in {ids[pos], *top2}}
            for tid, entry in entries[pos].items():
                assert entry["logprob"] == pytest.approx(float(ref[pos - 1, int(tid)]),
                                                         abs=1e-4)
        rejected(path, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")(
            server, tokenizer)

    def beam_search(server, tokenizer):
        """One beam without EOS is greedy decoding; n beams are n distinct choices, the
        greedy one among them only if it ranks first (not asserted); streamed, the same
        beams (the search's whole result in chunks).
        The search itself is checked against a torch reference in
        tests/e2e/test_openai_beam_search.py."""
        body = {"use_beam_search": True, "ignore_eos": True}
        greedy_ids = ids(ok(server, path, {"ignore_eos": True}))
        assert ids(ok(server, path, {**body, "n": 1})) == greedy_ids
        resp = ok(server, path, {**body, "n": 3})
        assert len({tuple(ids(resp, i)) for i in range(3)}) == 3
        streamed = post(server, path, {**body, "n": 3, "stream": True}).text
        events = [json.loads(line[6:]) for line in streamed.splitlines()
                  if line.startswith("data: {")]
        streamed_ids: dict[int, list[int]] = {}
        for c in (c for e in events for c in e["choices"]):
            streamed_ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
        assert [streamed_ids[i] for i in range(3)] == [ids(resp, i) for i in range(3)]

    def length_penalty(server, tokenizer):
        """Honoured with beam search (one beam without EOS: greedy whatever the penalty);
        without it a 400 naming it."""
        body = {"use_beam_search": True, "ignore_eos": True, "n": 1}
        assert ids(ok(server, path, {**body, "length_penalty": 2.0})) == \
            ids(ok(server, path, {"ignore_eos": True}))
        rejected(path, {"length_penalty": 2.0}, "length_penalty")(server, tokenizer)

    def cache_salt(server, tokenizer):
        """Salted, the same greedy tokens; what the salt does to prefix-cache hits
        (``cached_tokens``, by hand from the block size) is asserted in
        tests/e2e/test_openai_prompt_tokens_details.py (a server with the details on); an
        empty salt is a 400 naming it."""
        assert ids(ok(server, path, {"cache_salt": "tenant-1"})) == ids(ok(server, path, {}))
        rejected(path, {"cache_salt": ""}, "cache_salt")(server, tokenizer)

    def session_id(server, tokenizer):
        """vLLM 0.32's session: the same greedy tokens (it only tags the KV cache events;
        their session_id: tests/test_kv_events_session.py, a server with the events on); a
        non-string or one over 256 characters is a 400 naming it."""
        assert ids(ok(server, path, {"session_id": "conversation-1"})) == \
            ids(ok(server, path, {}))
        for bad in (7, "s" * 257):
            rejected(path, {"session_id": bad}, "session_id")(server, tokenizer)

    def allowed_token_ids(server, tokenizer):
        """The same greedy ids as a -100 bias on every other token (logit_bias's path)."""
        allowed = [7, 30, 200]
        got = ids(ok(server, path, {"allowed_token_ids": allowed}))
        others = {str(t): -100 for t in range(len(tokenizer)) if t not in allowed}
        assert set(got) <= set(allowed) and got != ids(ok(server, path, {}))
        assert got == ids(ok(server, path, {"logit_bias": others}))

    steer = {"logit_bias": {"66": 30}}  # "a" (id 66; " a" is 266) wins every step

    def bad_words(server, tokenizer):
        """A one-token word: "a" and " a" banned at every step, as -100 biases ban them. On
        completions, a two-token word ("aa": [66, 66] and [266, 66]) against the same
        request grown one token at a time, 66 biased away only after a generated 66 or 266
        (the oracle of vLLM's rule)."""
        assert ids(ok(server, path, steer))[:3] == [66, 66, 66]
        got = ids(ok(server, path, {**steer, "bad_words": ["a"]}))
        assert 66 not in got and \
            got == ids(ok(server, path, {"logit_bias": {"66": -100, "266": -100}}))
        if path != C:
            return
        prompt, grown = tokenizer.encode(PROMPT), []
        for _ in range(6):
            bias = {"66": -100} if grown and grown[-1] in (66, 266) else {"66": 30}
            grown += ids(ok(server, C, {"prompt": prompt + grown, "max_tokens": 1,
                                        "logit_bias": bias}))
        assert grown.count(66) >= 2 and grown != [66] * 6
        assert ids(ok(server, C, {**steer, "prompt": prompt, "max_tokens": 6,
                                  "bad_words": ["aa"]})) == grown

    def truncate_prompt_tokens(server, tokenizer):
        """The reply to the prompt's last k tokens sent as the prompt; usage counts k. A
        completion's text keeps its <bos>, as vLLM 0.32 cuts it (transformers' left-side
        truncation); the rendered chat, encoded without special tokens, its last k."""
        full = tokenizer.encode(PROMPT) if path == C else prompt_ids(server, {})
        kept = full[-5:]
        if path == C:
            side, tokenizer.truncation_side = tokenizer.truncation_side, "left"  # vLLM's
            kept = tokenizer(PROMPT, truncation=True, max_length=5)["input_ids"]
            tokenizer.truncation_side = side
            assert kept[0] == full[0] == tokenizer.bos_token_id != full[-5]
        resp = ok(server, path, {"truncate_prompt_tokens": 5})
        assert resp["usage"]["prompt_tokens"] == 5 < len(full)
        assert ids(resp) == ids(ok(server, C, {"prompt": kept})) != ids(ok(server, path, {}))
        if path == CH:
            assert resp["prompt_token_ids"] == kept
        whole = ok(server, path, {"truncate_prompt_tokens": -1})  # max_model_len - 1: no cut
        assert ids(whole) == ids(ok(server, path, {}))
        assert whole["usage"]["prompt_tokens"] == len(full)

    def return_tokens_as_token_ids(server, tokenizer):
        """Every logprobs token is "token_id:{id}", the chosen one's id the generated id; the
        logprobs are the plain request's (an alternative's id reads as its text: decoded
        alone, or after the ids before it where it holds part of a character)."""
        body = {"logprobs": 2} if path == C else {"logprobs": True, "top_logprobs": 2}
        plain, resp = ok(server, path, body), ok(server, path, {**body,
                                                                "return_tokens_as_token_ids": True})
        token_ids, named = ids(resp), [f"token_id:{t}" for t in ids(resp)]
        assert token_ids == ids(plain)
        if path == C:
            lp, plain_lp = resp["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
            assert lp["tokens"] == named and lp["token_logprobs"] == plain_lp["token_logprobs"]
            steps = [(top.items(), plain_top) for top, plain_top in
                     zip(lp["top_logprobs"], plain_lp["top_logprobs"])]
            assert all(name in top for name, top in zip(named, lp["top_logprobs"]))
        else:
            content = resp["choices"][0]["logprobs"]["content"]
            plain_content = plain["choices"][0]["logprobs"]["content"]
            assert [c["token"] for c in content] == named
            assert [c["bytes"] for c in content] == [c["bytes"] for c in plain_content]
            steps = [([(t["token"], t["logprob"]) for t in c["top_logprobs"]],
                      {t["token"]: t["logprob"] for t in p["top_logprobs"]})
                     for c, p in zip(content, plain_content)]
            assert all(t["bytes"] == list(t["token"].encode()) for c in content
                       for t in c["top_logprobs"])
        texts = LogprobTokenTexts(tokenizer)  # a partial character's: after the ids before
        for k, (top, plain_top) in enumerate(steps):
            decoded = {texts.texts([int(re.fullmatch(r"token_id:(\d+)", name)[1])],
                                   token_ids[:k])[0]: lp
                       for name, lp in top}
            if len(decoded) == len(plain_top):  # no two ids decode alike
                assert decoded == plain_top
        streamed = post(server, path, {**body, "return_tokens_as_token_ids": True,
                                       "stream": True})
        tokens = []  # streamed, the same names, event by event
        for line in streamed.text.splitlines():
            for choice in json.loads(line[6:])["choices"] if line.startswith("data: {") else []:
                lp = choice.get("logprobs") or {}
                tokens += lp.get("tokens") or [c["token"] for c in lp.get("content") or []]
        assert tokens == named

    def vllm_xargs(server, tokenizer):
        """Without --logits-processors nothing would read them: a 400 naming vllm_xargs
        (vLLM accepts and ignores them); a nested value is a 400 naming its key (the
        processors' use of them: tests/e2e/test_openai_logits_processors.py)."""
        rejected(path, {"vllm_xargs": {"k": 1, "l": ["a", 2.5]}}, "vllm_xargs")(server,
                                                                                 tokenizer)
        rejected(path, {"vllm_xargs": {"k": {"nested": 1}}}, "vllm_xargs.k")(server,
                                                                             tokenizer)

    def thinking_token_budget(server, tokenizer):
        """This server runs without --reasoning-parser: a budget is a 400 naming the field
        (vLLM 0.32 refuses it without a reasoning config); -1 (unlimited) and null give the
        baseline's ids. A value below -1 or not an integer is a 400 naming it; the budget
        honoured: tests/e2e/test_thinking_budget_served.py."""
        resp = post(server, path, {"thinking_token_budget": 4})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "thinking_token_budget", error
        assert "start the server with a --reasoning-parser" in error["message"], error
        base = ids(ok(server, path, {}))
        for value in (-1, None):
            assert ids(ok(server, path, {"thinking_token_budget": value})) == base
        for bad in (-2, 1.5, True, "3"):
            rejected(path, {"thinking_token_budget": bad}, "thinking_token_budget")(
                server, tokenizer)

    def stream_interval(server, tokenizer):
        """vLLM 0.32's: streamed, 3 tokens a chunk on a server at --stream-interval 1, the
        first at once and the last short (chunk ends at 1, 4, 7, 8 tokens; a stream read
        late may join chunks, never end one between them); the same ids as unstreamed; 0 is
        a 400 naming it (the interval itself: tests/test_stream_interval.py)."""
        body = {"max_tokens": 8, "ignore_eos": True, "stream_interval": 3}
        streamed = post(server, path, {**body, "stream": True, "stream_options": {
            "include_usage": True}}).text
        chunks = [c for line in streamed.splitlines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"] if c.get("token_ids")]
        ends = list(itertools.accumulate(len(c["token_ids"]) for c in chunks))
        assert set(ends) <= {1, 4, 7, 8} and ends[-1] == 8, ends
        assert [t for c in chunks for t in c["token_ids"]] == ids(ok(server, path, body))
        rejected(path, {"stream_interval": 0}, "stream_interval")(server, tokenizer)

    def repetition_detection(server, tokenizer):
        """vLLM 0.32's: steered to "a" (id 66) at every step, the reply ends where its ids
        first end with one token three times (hand-computed: 3 tokens), finish reason
        ``repetition``, stop reason ``repetition_detected``; max_pattern_size 0 is off; a
        min_count of 1 and an unknown key are 400s naming them, and so is the field with
        beam search (which ends beams at EOS or max_tokens only)."""
        body = {**steer, "max_tokens": 12, "ignore_eos": True}
        assert ids(ok(server, path, body)) == [66] * 12
        reply = ok(server, path, {**body, "repetition_detection": {
            "max_pattern_size": 2, "min_count": 3}})
        choice = reply["choices"][0]
        assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == \
            ([66] * 3, "repetition", "repetition_detected")
        assert reply["usage"]["completion_tokens"] == 3
        assert ids(ok(server, path, {**body, "repetition_detection": {
            "max_pattern_size": 0}})) == [66] * 12
        rejected(path, {"repetition_detection": {"max_pattern_size": 2, "min_count": 1}},
                 "repetition_detection.min_count")(server, tokenizer)
        rejected(path, {"repetition_detection": {"max_pattern_size": 2, "min_count": 2,
                                                 "size": 1}},
                 "repetition_detection.size")(server, tokenizer)
        rejected(path, {"repetition_detection": {"max_pattern_size": 2, "min_count": 2},
                        "use_beam_search": True}, "repetition_detection")(server, tokenizer)

    def logprob_token_ids(server, tokenizer):
        """vLLM 0.32's: every generated token's logprobs are its own and the listed ids'
        (named ``token_id:N``), equal to transformers' log-softmax over the same ids, in place
        of the top ones; without logprobs, empty, or with beam search, a 400 naming it."""
        import torch
        from transformers import AutoModelForCausalLM

        listed = [66, 200, 7]
        logprobs = {"logprobs": 1} if path == C else {"logprobs": True, "top_logprobs": 1}
        reply = ok(server, path, {**logprobs, "logprob_token_ids": listed, "max_tokens": 4,
                                  "return_tokens_as_token_ids": True})
        prompt = tokenizer.encode(PROMPT) if path == C else prompt_ids(server, {})
        generated = ids(reply)
        model = AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path,
                                                     dtype=torch.float32).eval()
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt + generated])).logits[0], -1)
        lp = reply["choices"][0]["logprobs"]
        steps = lp["top_logprobs"] if path == C else \
            [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in lp["content"]]
        for pos, (token, step) in enumerate(zip(generated, steps)):
            wanted = dict.fromkeys([token, *listed])
            names = [f"token_id:{t}" for t in wanted]  # chat: in vLLM's order
            assert (list(step) if path == CH else sorted(step)) == \
                (names if path == CH else sorted(names))
            for t in wanted:
                assert step[f"token_id:{t}"] == pytest.approx(
                    float(ref[len(prompt) - 1 + pos, t]), abs=1e-4)
        rejected(path, {"logprob_token_ids": listed}, "logprob_token_ids")(server, tokenizer)
        rejected(path, {**logprobs, "logprob_token_ids": []}, "logprob_token_ids")(server,
                                                                                   tokenizer)
        rejected(path, {**logprobs, "logprob_token_ids": listed, "use_beam_search": True},
                 "logprob_token_ids")(server, tokenizer)

    return {
        "model": rejected(path, {"model": "gpt-4"}, "model", 404), "request_id": request_id,
        "logprob_token_ids": logprob_token_ids,
        "cache_salt": cache_salt, "session_id": session_id, "vllm_xargs": vllm_xargs,
        "thinking_token_budget": thinking_token_budget,
        "stream_interval": stream_interval, "repetition_detection": repetition_detection,
        # no --kv-transfer-config here (the P/D pair takes it: test_openai_kv_transfer.py)
        "kv_transfer_params": rejected(path, {"kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False}}, "kv_transfer_params"),
        "allowed_token_ids": allowed_token_ids, "bad_words": bad_words,
        "truncate_prompt_tokens": truncate_prompt_tokens,
        "return_tokens_as_token_ids": return_tokens_as_token_ids,
        "target_ttft_ms": target_ttft_ms, "target_tpot_ms": target_tpot_ms,
        "n": n, "temperature": temperature, "seed": seed,
        "top_p": hot_differs_and_filter_restores("top_p", 1e-6),
        "top_k": hot_differs_and_filter_restores("top_k", 1),
        "min_p": hot_differs_and_filter_restores("min_p", 1.0),
        "stop": stop, "include_stop_str_in_output": include_stop,
        "stop_token_ids": stop_token_ids, "logit_bias": logit_bias, "ignore_eos": ignore_eos,
        "min_tokens": min_tokens, "skip_special_tokens": skip_special_tokens,
        "spaces_between_special_tokens": spaces_between_special_tokens,
        "presence_penalty": penalty("presence_penalty", 2.0),
        "frequency_penalty": penalty("frequency_penalty", 2.0),
        "repetition_penalty": penalty("repetition_penalty", 5.0),
        "user": user, "stream": stream, "stream_options": stream_options,
        "return_token_ids": return_token_ids,
        "response_format": constraint({"response_format": {"type": "json_object"}},
                                      lambda t: t.startswith("{")),
        "structured_outputs": choice,
        "guided_json": constraint({"guided_json": {"enum": ["abc"]}}, lambda t: t == '"abc"'),
        "guided_regex": constraint({"guided_regex": "[0-9]{3}"},
                                   lambda t: len(t) == 3 and t.isdigit()),
        "guided_choice": constraint({"guided_choice": ["yes", "no"]},
                                    lambda t: t in ("yes", "no")),
        "guided_grammar": constraint({"guided_grammar": 'root ::= "a" | "b"'},
                                     lambda t: t in ("a", "b")),
        "priority": priority,
        "best_of": rejected(path, {"best_of": 2}, "best_of"),
        "use_beam_search": beam_search, "length_penalty": length_penalty,
        "prompt_logprobs": prompt_logprobs,
    }


# ---- /v1/completions -------------------------------------------------------------------------
def completion_cases() -> dict[str, Callable]:
    def prompt(server, tokenizer):
        a = ok(server, C, {})
        b = ok(server, C, {"prompt": "lazy dog"})
        assert a["usage"]["prompt_tokens"] == len(tokenizer.encode(PROMPT)) and ids(a) != ids(b)

    def max_tokens(server, tokenizer):
        assert len(ids(ok(server, C, {"max_tokens": 3}))) == 3

    def echo(server, tokenizer):
        assert text(ok(server, C, {"echo": True})) == PROMPT + text(ok(server, C, {}))

    def logprobs(server, tokenizer):
        lp = ok(server, C, {"logprobs": 2})["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 8 and all(len(t) >= 2 for t in lp["top_logprobs"])

    def add_special_tokens(server, tokenizer):
        with_bos = ok(server, C, {})["usage"]["prompt_tokens"]
        assert ok(server, C, {"add_special_tokens": False})["usage"]["prompt_tokens"] == \
            with_bos - 1 == len(tokenizer.encode(PROMPT, add_special_tokens=False))

    def prompt_logprobs(server, tokenizer):
        choice = ok(server, C, {"prompt_logprobs": 2})["choices"][0]
        entries = choice["prompt_logprobs"]
        prompt = tokenizer.encode(PROMPT)
        assert len(entries) == len(prompt) and entries[0] is None
        assert all(str(t) in e and len(e) >= 2 for t, e in zip(prompt[1:], entries[1:]))

    return {**sampling_cases(C), "prompt": prompt, "max_tokens": max_tokens, "echo": echo,
            "logprobs": logprobs, "add_special_tokens": add_special_tokens,
            "prompt_logprobs": prompt_logprobs,
            "suffix": rejected(C, {"suffix": " the end"}, "suffix"),
            # this server runs without --enable-prompt-embeds (the flag is named before the
            # value is read); used: tests/e2e/test_openai_prompt_embeds.py
            "prompt_embeds": rejected(C, {"prompt_embeds": "AAAA"}, "prompt_embeds")}


# ---- /v1/chat/completions --------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "get_x", "parameters": {
    "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}
# A template that reads tools (the tiny model's ignores them: kvflow would then add the tool
# parser's long instructions as a system prompt, too long for the tiny context).
TOOLS_TEMPLATE = "{{ messages[0].content }}{% for t in tools or [] %} {{ t.function.name }}{% endfor %}"


def prompt_ids(server, body: dict[str, Any]) -> list[int]:
    return ok(server, CH, {**body, "max_tokens": 1})["prompt_token_ids"]


def chat_cases() -> dict[str, Callable]:
    def rendered(tokenizer, messages, **kwargs) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs),
                                add_special_tokens=False)

    def messages(server, tokenizer):
        msgs = [{"role": "user", "content": "lazy dog"}]
        assert prompt_ids(server, {"messages": msgs}) == \
            rendered(tokenizer, msgs, add_generation_prompt=True)

    def max_tokens(field: str) -> Callable:
        def check(server, tokenizer):
            assert len(ids(ok(server, CH, {"max_tokens": None, field: 3}))) == 3
        return check

    def logprobs(server, tokenizer):
        out = ok(server, CH, {"logprobs": True, "top_logprobs": 2})["choices"][0]["logprobs"]
        assert len(out["content"]) == 8 and all(len(t["top_logprobs"]) == 2
                                                for t in out["content"])

    def add_generation_prompt(server, tokenizer):
        assert prompt_ids(server, {"add_generation_prompt": False}) == \
            rendered(tokenizer, HI, add_generation_prompt=False)

    def continue_final_message(server, tokenizer):
        msgs = [*HI, {"role": "assistant", "content": "the lazy"}]
        body = {"messages": msgs, "add_generation_prompt": False}
        assert prompt_ids(server, {**body, "continue_final_message": True}) == \
            rendered(tokenizer, msgs, continue_final_message=True)
        assert post(server, CH, {**body, "add_generation_prompt": True,
                                 "continue_final_message": True}).status_code == 400
        # a last message of another role is continued too (transformers' and vLLM's rule)
        assert prompt_ids(server, {"add_generation_prompt": False,
                                   "continue_final_message": True}) == \
            rendered(tokenizer, HI, continue_final_message=True)

    def echo(server, tokenizer):
        """vLLM's rule: the last message's content comes before the reply when it has the
        reply's role (streaming, n and the prompt logprobs: tests/test_chat_echo.py)."""
        msgs = [*HI, {"role": "assistant", "content": "the lazy"}]
        body = {"messages": msgs, "add_generation_prompt": False,
                "continue_final_message": True}
        assert text(ok(server, CH, {**body, "echo": True})) == \
            "the lazy" + text(ok(server, CH, body))
        assert text(ok(server, CH, {"echo": True})) == text(ok(server, CH, {}))  # user's last

    def add_special_tokens(server, tokenizer):
        assert prompt_ids(server, {"add_special_tokens": True}) == \
            [tokenizer.bos_token_id, *prompt_ids(server, {})]

    def chat_template(server, tokenizer):
        assert prompt_ids(server, {"chat_template": "{{ messages[0].content }} fox"}) == \
            tokenizer.encode("hi fox", add_special_tokens=False)

    def chat_template_kwargs(server, tokenizer):
        body = {"chat_template": "{{ greeting }} dog", "chat_template_kwargs": {"greeting": "a"}}
        assert prompt_ids(server, body) == tokenizer.encode("a dog", add_special_tokens=False)
        resp = post(server, CH, {"chat_template_kwargs": {"tokenize": True}})
        assert resp.json()["error"]["param"] == "chat_template_kwargs.tokenize"
        # a variable the (model's) template never reads: dropped with a 200 before
        for path in (CH, TOK):
            resp = post(server, path, {"messages": HI, "max_tokens": 2,
                                       "chat_template_kwargs": {"enable_thinking": False}}
                        if path == CH else {"messages": HI, "chat_template_kwargs":
                                            {"enable_thinking": False}}, base=False)
            assert (resp.status_code, resp.json()) == (400, {"error": {
                "message": "this chat template does not use chat_template_kwargs."
                           "enable_thinking (it reads no variable of that name): leave it "
                           "out for this model (a server started with "
                           "--ignore-unknown-fields drops such keys, as vLLM does)",
                "type": "invalid_request_error", "param": "chat_template_kwargs.enable_thinking",
                "code": "invalid_value"}})

    def documents(server, tokenizer):
        docs = [{"title": "t", "text": "lazy dog"}]
        body = {"documents": docs, "chat_template": "{{ documents[0].text }}"}
        assert prompt_ids(server, body) == tokenizer.encode("lazy dog", add_special_tokens=False)
        rejected(CH, {"documents": docs}, "documents")(server, tokenizer)  # template ignores

    def reasoning_effort(server, tokenizer):
        """vLLM's rule: the template variable ``reasoning_effort`` (and ``enable_thinking``
        true unless "none"); a template reading neither is a 400 naming the field."""
        body = {"chat_template": "{{ reasoning_effort }} {{ enable_thinking }} dog",
                "reasoning_effort": "low"}
        assert prompt_ids(server, body) == tokenizer.encode("low True dog",
                                                            add_special_tokens=False)
        assert prompt_ids(server, {**body, "reasoning_effort": "none"}) == \
            tokenizer.encode("none False dog", add_special_tokens=False)
        rejected(CH, {"reasoning_effort": "low"}, "reasoning_effort")(server, tokenizer)

    def tool_choice(server, tokenizer):
        body = {"tools": [TOOL], "chat_template": TOOLS_TEMPLATE,
                "tool_choice": {"type": "function", "function": {"name": "get_x"}}}
        call = ok(server, CH, {**HOT, **body})["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_x"
        assert json.loads(call["function"]["arguments"])["x"] in (1, 2)

    def parallel_tool_calls(server, tokenizer):
        """A "," bias makes the model add calls to the required array unless parallel tool
        calls are off (then the grammar allows only one)."""
        comma = tokenizer.encode(",", add_special_tokens=False)
        body = {**HOT, "max_tokens": 40, "tools": [TOOL], "tool_choice": "required",
                "chat_template": TOOLS_TEMPLATE, "logit_bias": {str(comma[0]): 30}}
        many = ok(server, CH, body)["choices"][0]
        one = ok(server, CH, {**body, "parallel_tool_calls": False})["choices"][0]
        assert len(one["message"]["tool_calls"]) == 1
        assert len(many["message"]["tool_calls"]) > 1 or many["finish_reason"] == "length"

    def same_reply(value: dict[str, Any], refused: dict[str, Any] | None = None) -> Callable:
        """An OpenAI field about the platform, not the reply: accepted, the same greedy ids
        and length (8, max_tokens) as without it; ``refused``, a value asking for what
        kvflow does not do, is a 400 naming the field."""
        def check(server, tokenizer):
            plain = ids(ok(server, CH, {}))
            assert len(plain) == 8 and ids(ok(server, CH, value)) == plain
            if refused is not None:
                rejected(CH, refused, next(iter(refused)))(server, tokenizer)
        return check

    def service_tier(server, tokenizer):
        """Accepted with the same reply, which then names the tier that served it, as
        OpenAI's does: "default", kvflow's one tier (``auto`` resolves to it), on every
        streamed chunk too; a request that sends none gets no such field; ``flex`` is a 400."""
        same_reply({"service_tier": "default"}, {"service_tier": "flex"})(server, tokenizer)
        assert "service_tier" not in ok(server, CH, {})
        for sent in ("auto", "default"):
            assert ok(server, CH, {"service_tier": sent})["service_tier"] == "default"
            body = {"service_tier": sent, "stream": True,
                    "stream_options": {"include_usage": True}}
            events = [json.loads(line[6:]) for line in post(server, CH, body).text.splitlines()
                      if line.startswith("data: {")]
            assert len(events) > 2 and [e.get("service_tier") for e in events] == \
                ["default"] * len(events), events

    def safety_identifier(server, tokenizer):
        same_reply({"safety_identifier": "sid-4c1d"})(server, tokenizer)
        assert "safety_identifier 'sid-4c1d'" in server.log()

    def return_prompt_text(server, tokenizer):
        """vLLM 0.32's: the rendered prompt as ``prompt_text`` (transformers' rendering is
        the oracle); none unless asked."""
        reply = ok(server, CH, {"return_prompt_text": True})
        assert reply["prompt_text"] == tokenizer.apply_chat_template(
            HI, tokenize=False, add_generation_prompt=True)
        assert "prompt_text" not in ok(server, CH, {})

    def include_reasoning(server, tokenizer):
        """Without --reasoning-parser there is no reasoning to drop: the reply is the same
        (with a parser: tests/e2e/test_openai_tool_parsers_served.py); not a boolean, a 400."""
        same_reply({"include_reasoning": False},
                   {"include_reasoning": "sometimes"})(server, tokenizer)

    def tools(server, tokenizer):
        body = {"tools": [TOOL], "tool_choice": "auto", "chat_template": TOOLS_TEMPLATE}
        assert prompt_ids(server, body) == tokenizer.encode("hi get_x", add_special_tokens=False)
        # tool_choice none: the template still gets the tools (OpenAI's and vLLM's default)
        assert prompt_ids(server, {**body, "tool_choice": "none"}) == \
            tokenizer.encode("hi get_x", add_special_tokens=False)

    return {**sampling_cases(CH), "messages": messages,
            "max_tokens": max_tokens("max_tokens"),
            "max_completion_tokens": max_tokens("max_completion_tokens"),
            "logprobs": logprobs, "top_logprobs": logprobs,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "add_special_tokens": add_special_tokens, "chat_template": chat_template,
            "chat_template_kwargs": chat_template_kwargs, "documents": documents,
            "reasoning_effort": reasoning_effort,
            # the tiny Llama takes no images (a vision model's case:
            # tests/multimodal/test_mm_processor_kwargs.py)
            "mm_processor_kwargs": rejected(CH, {"mm_processor_kwargs": {"max_pixels": 1}},
                                            "mm_processor_kwargs"),
            "echo": echo, "tools": tools,
            "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls,
            "metadata": same_reply({"metadata": {"team": "a", "run": "7"}},
                                   {"metadata": {f"k{i}": "v" for i in range(17)}}),
            "store": same_reply({"store": False}, {"store": True}),
            "service_tier": service_tier,
            "prompt_cache_key": same_reply({"prompt_cache_key": "conversation-9"}),
            "safety_identifier": safety_identifier,
            "return_prompt_text": return_prompt_text, "include_reasoning": include_reasoning}


# ---- /tokenize, /detokenize ------------------------------------------------------------------
def tokenize_cases() -> dict[str, Callable]:
    def tokens(server, body):
        return ok(server, TOK, body)["tokens"]

    def prompt(server, tokenizer):
        assert tokens(server, {}) == tokenizer.encode(PROMPT)

    def add_special_tokens(server, tokenizer):
        assert tokens(server, {"add_special_tokens": False}) == \
            tokenizer.encode(PROMPT, add_special_tokens=False)
        chat = {"prompt": None, "messages": HI}
        assert tokens(server, {**chat, "add_special_tokens": True})[0] == tokenizer.bos_token_id

    def chat_option(body: dict[str, Any], expected: Callable) -> Callable:
        def check(server, tokenizer):
            got = tokens(server, {"prompt": None, "messages": HI, **body})
            assert got == tokenizer.encode(expected(tokenizer), add_special_tokens=False)
        return check

    def messages_text(tokenizer, **kwargs):
        return tokenizer.apply_chat_template(HI, tokenize=False, **kwargs)

    def return_token_strs(server, tokenizer):  # vLLM's field; it was silently ignored
        expected = tokenizer.convert_ids_to_tokens(tokenizer.encode(PROMPT))
        assert ok(server, TOK, {"return_token_strs": True})["token_strs"] == expected
        assert "token_strs" not in ok(server, TOK, {})

    return {
        "model": rejected(TOK, {"model": "gpt-4"}, "model", 404), "prompt": prompt,
        "messages": chat_option({}, lambda t: messages_text(t, add_generation_prompt=True)),
        "add_special_tokens": add_special_tokens,
        "add_generation_prompt": chat_option({"add_generation_prompt": False}, messages_text),
        # a final user message is continued, as transformers and vLLM continue it
        "continue_final_message": chat_option(
            {"add_generation_prompt": False, "continue_final_message": True},
            lambda t: messages_text(t, continue_final_message=True)),
        "chat_template": chat_option({"chat_template": "{{ messages[0].content }}!"},
                                     lambda t: "hi!"),
        "chat_template_kwargs": chat_option(
            {"chat_template": "{{ x }}", "chat_template_kwargs": {"x": "fox"}}, lambda t: "fox"),
        "tools": chat_option({"tools": [TOOL], "chat_template": "{{ tools[0].function.name }}"},
                             lambda t: "get_x"),
        # none: a template that ignores tools gets no tool instructions (auto: a system
        # message holding them comes first)
        "tool_choice": chat_option({"tools": [TOOL], "tool_choice": "none", "chat_template":
                                    "{% for m in messages %}{{ m.role }}:{{ m.content }};"
                                    "{% endfor %}"}, lambda t: "user:hi;"),
        "documents": chat_option({"documents": [{"text": "dog"}],
                                  "chat_template": "{{ documents[0].text }}"}, lambda t: "dog"),

        "return_token_strs": return_token_strs,
    }


def detokenize_cases() -> dict[str, Callable]:
    def tokens(server, tokenizer):
        assert ok(server, DETOK, {})["prompt"] == tokenizer.decode([5, 6, 7])

    return {"model": rejected(DETOK, {"model": "gpt-4"}, "model", 404), "tokens": tokens}


# ---- /v1/load_lora_adapter, /v1/unload_lora_adapter ------------------------------------------
def lora_cases() -> dict[str, Callable]:
    def greedy(server, model: str | None) -> list[int]:
        return ids(ok(server, C, {"max_tokens": 16, **({"model": model} if model else {})}))

    def load(name: str) -> Callable:
        def check(server, tokenizer):
            resp = post(server, LOAD, {"lora_name": name, "lora_path": server.lora_path})
            assert resp.status_code == 200, resp.text
            assert greedy(server, name) != greedy(server, None)  # the adapter answers as name
        return check

    def lora_path(server, tokenizer):
        load("lora-path")(server, tokenizer)
        rejected(LOAD, {"lora_name": "missing", "lora_path": "/nonexistent"},
                 "lora_path")(server, tokenizer)

    def unload(server, tokenizer):
        load("to-unload")(server, tokenizer)
        resp = post(server, UNLOAD, {"lora_name": "to-unload"})
        assert resp.status_code == 200, resp.text
        assert post(server, C, {"model": "to-unload"}).status_code == 404
        rejected(UNLOAD, {"lora_name": "to-unload"}, "lora_name", 404)(server, tokenizer)

    def load_inplace(server, tokenizer):
        """A name in use: a 400 naming lora_name without it, replaced with it (a 200; its
        replies are checked against transformers + peft in test_openai_lora.py)."""
        load("in-place")(server, tokenizer)
        again = {"lora_name": "in-place", "lora_path": server.lora_path}
        rejected(LOAD, again, "lora_name")(server, tokenizer)
        resp = post(server, LOAD, {**again, "load_inplace": True})
        assert resp.status_code == 200, resp.text
        assert greedy(server, "in-place") != greedy(server, None)

    return {LOAD: {"lora_name": load("lora-name"), "lora_path": lora_path,
                   "load_inplace": load_inplace},
            UNLOAD: {"lora_name": unload}}


# ---- /v1/embeddings (a server of its own: an embedding model) -------------------------------
def embedding_cases() -> dict[str, Callable]:
    def vector(resp: dict[str, Any]) -> list[float]:
        return resp["data"][0]["embedding"]

    embed_text = (EMBED_PROMPT + PROMPT).lower()  # as the model's config prepares it

    def input_(server, tokenizer):
        a, b = ok(server, EMB, {}), ok(server, EMB, {"input": "lazy dog"})
        assert a["usage"]["prompt_tokens"] == len(tokenizer.encode(embed_text))  # with <bos>
        assert vector(a) != vector(b) and len(vector(a)) == 64

    def add_special_tokens(server, tokenizer):
        """False: the text's ids without ``<bos>`` (usage and vector those of the ids sent
        as tokens); true is the default."""
        plain = tokenizer.encode(embed_text, add_special_tokens=False)
        assert tokenizer.encode(embed_text) == [tokenizer.bos_token_id, *plain]
        bare = ok(server, EMB, {"add_special_tokens": False})
        assert bare["usage"]["prompt_tokens"] == len(plain)
        assert vector(bare) == pytest.approx(vector(ok(server, EMB, {"input": plain})),
                                             abs=1e-6)
        assert vector(bare) != pytest.approx(vector(ok(server, EMB, {})), abs=1e-3)
        assert vector(ok(server, EMB, {"add_special_tokens": True})) == \
            vector(ok(server, EMB, {}))
        rejected(EMB, {"add_special_tokens": "no"}, "add_special_tokens")(server, tokenizer)

    def normalize(server, tokenizer):
        """False: the raw last-token vector (this model normalizes by default), so the
        default one is it divided by its norm (the sentence-transformers oracle is in
        tests/e2e/test_openai_embeddings.py); a non-bool is a 400 naming it."""
        raw, unit = vector(ok(server, EMB, {"normalize": False})), vector(ok(server, EMB, {}))
        norm = sum(v * v for v in raw) ** 0.5
        assert abs(norm - 1.0) > 1e-2
        assert unit == pytest.approx([v / norm for v in raw], abs=1e-6)
        assert vector(ok(server, EMB, {"normalize": True})) == unit
        rejected(EMB, {"normalize": 1}, "normalize")(server, tokenizer)

    def use_activation(server, tokenizer):
        """vLLM 0.32's name of normalize: false the raw vector, true the normalized one;
        disagreeing with normalize, or a non-bool, is a 400 naming it."""
        raw, unit = vector(ok(server, EMB, {"normalize": False})), vector(ok(server, EMB, {}))
        assert vector(ok(server, EMB, {"use_activation": False})) == raw
        assert vector(ok(server, EMB, {"use_activation": True})) == unit
        assert vector(ok(server, EMB, {"use_activation": False, "normalize": False})) == raw
        rejected(EMB, {"use_activation": False, "normalize": True},
                 "use_activation")(server, tokenizer)
        rejected(EMB, {"use_activation": 1}, "use_activation")(server, tokenizer)

    def encoding_format(server, tokenizer):
        import base64

        import numpy as np

        packed = vector(ok(server, EMB, {"encoding_format": "base64"}))
        values = np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist()
        assert values == pytest.approx(vector(ok(server, EMB, {})), abs=1e-7)
        rejected(EMB, {"encoding_format": "int8"}, "encoding_format")(server, tokenizer)

    def embed_dtype(server, tokenizer):
        """base64 bytes of the vector cast to it: torch's own float16 cast of the float
        reply, bit for bit (every dtype and byte order against torch, and
        ``encoding_format: bytes``: tests/e2e/test_openai_embeddings.py); an unknown dtype,
        or one with ``encoding_format`` float (no bytes to cast), is a 400 naming it."""
        import base64

        import torch

        floats = torch.tensor(vector(ok(server, EMB, {})), dtype=torch.float32)
        packed = vector(ok(server, EMB, {"encoding_format": "base64", "embed_dtype": "float16",
                                         "endianness": "little"}))
        got = torch.frombuffer(bytearray(base64.b64decode(packed)), dtype=torch.uint8)
        assert torch.equal(got, floats.to(torch.float16).view(torch.uint8))  # little-endian host
        rejected(EMB, {"encoding_format": "base64", "embed_dtype": "int8"},
                 "embed_dtype")(server, tokenizer)
        rejected(EMB, {"embed_dtype": "float16"}, "embed_dtype")(server, tokenizer)

    def endianness(server, tokenizer):
        """big: each float32 value's bytes most significant first (numpy's ``>f4`` reads the
        float reply back exactly); with ``encoding_format`` float a 400 naming it."""
        import base64

        import numpy as np

        packed = vector(ok(server, EMB, {"encoding_format": "base64", "endianness": "big"}))
        assert np.frombuffer(base64.b64decode(packed), dtype=">f4").tolist() == \
            vector(ok(server, EMB, {}))
        rejected(EMB, {"endianness": "big"}, "endianness")(server, tokenizer)
        rejected(EMB, {"encoding_format": "base64", "endianness": "middle"},
                 "endianness")(server, tokenizer)

    def priority(server, tokenizer):
        """Orders the waiting queue under --policy priority (accepted there:
        tests/e2e/test_openai_embeddings.py); this server runs fcfs, so a nonzero priority,
        which it would ignore, is a 400 naming it, and 0 is the default."""
        assert vector(ok(server, EMB, {"priority": 0})) == vector(ok(server, EMB, {}))
        rejected(EMB, {"priority": 1}, "priority")(server, tokenizer)

    def dimensions(server, tokenizer):
        full, cut = vector(ok(server, EMB, {})), vector(ok(server, EMB, {"dimensions": 8}))
        norm = sum(v * v for v in full[:8]) ** 0.5
        assert cut == pytest.approx([v / norm for v in full[:8]], abs=1e-6)
        rejected(EMB, {"dimensions": 65}, "dimensions")(server, tokenizer)

    def user(server, tokenizer):
        ok(server, EMB, {"user": "user-e1b2"})
        assert "user 'user-e1b2'" in server.log()

    def truncate_prompt_tokens(server, tokenizer):
        """k: a text as its tokenizer truncates it (its first k ids, ``<bos>`` included),
        token ids their first k too, as vLLM's pooling runner keeps them (each the vector of
        those ids sent whole); -1 (max_model_len) cuts nothing here; 0 is a 400 naming
        it."""
        ids = tokenizer.encode(embed_text)
        assert len(ids) > 3
        cut = ok(server, EMB, {"truncate_prompt_tokens": 3})
        assert cut["usage"]["prompt_tokens"] == 3
        first = vector(ok(server, EMB, {"input": ids[:3]}))
        assert vector(cut) == pytest.approx(first, abs=1e-6)
        assert vector(ok(server, EMB, {"input": ids, "truncate_prompt_tokens": 3})) == \
            pytest.approx(first, abs=1e-6)
        assert vector(ok(server, EMB, {"truncate_prompt_tokens": -1})) == \
            vector(ok(server, EMB, {}))
        rejected(EMB, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")(server,
                                                                                tokenizer)

    def truncation_side(server, tokenizer):
        """vLLM's: "left" keeps the last k of the whole encoding (a text's ``<bos>`` cut
        too, as vLLM slices after encoding), of token ids too; "right" the first k; another
        value is a 400 naming it."""
        ids = tokenizer.encode(embed_text)
        assert len(ids) > 3 and ids[0] == tokenizer.bos_token_id
        last = vector(ok(server, EMB, {"input": ids[-3:]}))
        for value in (PROMPT, ids):
            body = {"input": value, "truncate_prompt_tokens": 3}
            assert vector(ok(server, EMB, {**body, "truncation_side": "left"})) == \
                pytest.approx(last, abs=1e-6)
            assert vector(ok(server, EMB, {**body, "truncation_side": "right"})) == \
                pytest.approx(vector(ok(server, EMB, {"input": ids[:3]})), abs=1e-6)
        assert last != pytest.approx(vector(ok(server, EMB, {"input": ids[:3]})), abs=1e-3)
        rejected(EMB, {"truncate_prompt_tokens": 3, "truncation_side": "middle"},
                 "truncation_side")(server, tokenizer)

    def padding(server, tokenizer):
        """vLLM 0.32's: "max_length" pads the prompt's ids with the tokenizer's pad token to
        max_model_len (the vector of those ids sent as input; usage counts them);
        "do_not_pad" pads nothing; another value is a 400 naming it."""
        assert vector(ok(server, EMB, {"padding": "do_not_pad"})) == vector(ok(server, EMB, {}))
        length = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
        ids = tokenizer.encode(embed_text)
        assert len(ids) < length
        pad = tokenizer.eos_token_id  # the embedding model's pad: save_sentence_transformer
        padded = ids + [pad] * (length - len(ids))
        reply = ok(server, EMB, {"padding": "max_length"})
        assert reply["usage"]["prompt_tokens"] == length
        assert vector(reply) == pytest.approx(vector(ok(server, EMB, {"input": padded})),
                                              abs=1e-6)
        rejected(EMB, {"padding": "longest"}, "padding")(server, tokenizer)

    def request_id(server, tokenizer):
        reply = ok(server, EMB, {"request_id": "trace-7"})
        assert reply["id"] == "embd-trace-7" and vector(reply) == vector(ok(server, EMB, {}))

    # vLLM's chat-style request: ``messages`` rendered by the chat template (the server's
    # TINY_CHAT_TEMPLATE, rendered here by hand) and embedded as the rendered text's ids,
    # without <bos> (add_special_tokens defaults to false for messages)
    hi = [{"role": "user", "content": "lazy dog"}]

    def as_ids(server, tokenizer, text: str) -> list[float]:
        return vector(ok(server, EMB, {"input": tokenizer.encode(text,
                                                                 add_special_tokens=False)}))

    def chat(server, body: dict[str, Any]) -> list[float]:
        return vector(ok(server, EMB, {"input": None, "messages": hi, **body}))

    def messages(server, tokenizer):
        assert chat(server, {}) == pytest.approx(as_ids(server, tokenizer, "<user>lazy dog\n"),
                                                 abs=1e-6)
        rejected(EMB, {"messages": hi}, "messages")(server, tokenizer)  # with input too

    def add_generation_prompt(server, tokenizer):
        assert chat(server, {"add_generation_prompt": True}) == pytest.approx(
            as_ids(server, tokenizer, "<user>lazy dog\n<assistant>"), abs=1e-6)
        rejected(EMB, {"add_generation_prompt": True}, "add_generation_prompt")(server,
                                                                                 tokenizer)

    def continue_final_message(server, tokenizer):
        got = vector(ok(server, EMB, {"input": None, "continue_final_message": True,
                                      "messages": [*hi, {"role": "assistant",
                                                         "content": "it runs"}]}))
        assert got == pytest.approx(
            as_ids(server, tokenizer, "<user>lazy dog\n<assistant>it runs"), abs=1e-6)

    def chat_template(server, tokenizer):
        template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
        assert chat(server, {"chat_template": template}) == pytest.approx(
            as_ids(server, tokenizer, "[lazy dog]"), abs=1e-6)

    def chat_template_kwargs(server, tokenizer):
        template = "{{ lead }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        assert chat(server, {"chat_template": template,
                             "chat_template_kwargs": {"lead": "query: "}}) == \
            pytest.approx(as_ids(server, tokenizer, "query: lazy dog"), abs=1e-6)

    return {"model": rejected(EMB, {"model": "gpt-4"}, "model", 404), "input": input_,
            "encoding_format": encoding_format, "dimensions": dimensions, "user": user,
            "request_id": request_id, "add_special_tokens": add_special_tokens,
            "normalize": normalize, "use_activation": use_activation,
            "truncate_prompt_tokens": truncate_prompt_tokens,
            "truncation_side": truncation_side, "padding": padding,
            "embed_dtype": embed_dtype, "endianness": endianness, "priority": priority,
            "messages": messages, "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "chat_template": chat_template,
            "chat_template_kwargs": chat_template_kwargs}


# ---- /v1/responses: vLLM 0.32's sampling and template fields (CHAT_FIELDS) -----------------
def output_text(reply: dict[str, Any]) -> str:
    """A /v1/responses reply's message text (its output_text parts, joined)."""
    return "".join(part["text"] for item in reply["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def responses_cases() -> dict[str, Callable]:
    """One check per ``responses_api.CHAT_FIELDS`` field (each was an unknown field, a 400
    naming it, before vLLM 0.32's Responses request was compared), against a hand-computed
    value (forced tokens, the tokenizer) or a baseline reply, as the chat cases above;
    ``truncation: auto`` (a 400 before, vLLM 0.32 honours it); ``request_id`` (a 400
    before: vLLM 0.32's response id); and
    ``thinking_token_budget``, which vLLM 0.32's Responses request does not declare."""
    hot = {"temperature": 2.0, "seed": 0, "max_output_tokens": 16}  # far from greedy
    forced = {"max_output_tokens": 16,
              "structured_outputs": {"regex": "the quick brown fox jumps"}}
    eos_bias = {"logit_bias": {"0": 100}}  # <eos> is id 0

    def reply(server, body: dict[str, Any]) -> str:
        return output_text(ok(server, R, body))

    def greedy(server) -> str:
        return reply(server, {"max_output_tokens": 16})

    def filter_restores_greedy(field: str, value: Any) -> Callable:
        def check(server, tokenizer):
            assert reply(server, hot) != greedy(server)
            assert reply(server, {**hot, field: value}) == greedy(server)
            rejected(R, {field: -5}, field)(server, tokenizer)
        return check

    def penalty(field: str, value: float) -> Callable:
        def check(server, tokenizer):
            plain = ok(server, R, {"max_output_tokens": 32})
            assert reply(server, {"max_output_tokens": 32, field: value}) != output_text(plain)
            rejected(R, {field: -3.0}, field)(server, tokenizer)
        return check

    def seed(server, tokenizer):
        a, b = (reply(server, {**hot, "seed": s}) for s in (0, 1))
        assert a != b and a == reply(server, hot)

    def stop(server, tokenizer):
        out = ok(server, R, {**forced, "stop": ["brown"]})
        assert (output_text(out), out["status"]) == ("the quick ", "completed")

    def include_stop_str_in_output(server, tokenizer):
        body = {**forced, "stop": "brown", "include_stop_str_in_output": True}
        assert reply(server, body) == "the quick brown"

    def structured_outputs(server, tokenizer):
        assert reply(server, {**hot, **forced, "max_output_tokens": 32}) == \
            "the quick brown fox jumps"
        both = {**forced, "text": {"format": {"type": "json_object"}}}
        assert post(server, R, both).status_code == 400

    def logit_bias(server, tokenizer):
        assert reply(server, {"logit_bias": {"7": 100}}) == tokenizer.decode([7] * 8)

    def stop_token_ids(server, tokenizer):
        out = ok(server, R, {"logit_bias": {"7": 100}, "stop_token_ids": [7]})
        assert (out["status"], out["usage"]["output_tokens"]) == ("completed", 1)

    def ignore_eos(server, tokenizer):
        plain = ok(server, R, eos_bias)
        assert (plain["status"], plain["usage"]["output_tokens"]) == ("completed", 1)
        kept = ok(server, R, {**eos_bias, "ignore_eos": True})
        assert (kept["status"], kept["usage"]["output_tokens"]) == ("incomplete", 8)

    def skip_special_tokens(server, tokenizer):
        body = {**eos_bias, "ignore_eos": True, "max_output_tokens": 2}
        assert reply(server, body) == ""
        assert reply(server, {**body, "skip_special_tokens": False}) == "<eos><eos>"

    def chat_template_kwargs(server, tokenizer):
        """Checked by the chat path's template rules, each key named (it was an unknown
        field, named whole): a variable the model's template never reads, and one of the
        renderer's own parameters, are each a 400 naming the key; an empty dict renders the
        plain prompt. (The model's template reads no other variable: the chat case above
        shows one read.)"""
        rejected(R, {"chat_template_kwargs": {"enable_thinking": False}},
                 "chat_template_kwargs.enable_thinking")(server, tokenizer)
        rejected(R, {"chat_template_kwargs": {"add_generation_prompt": False}},
                 "chat_template_kwargs.add_generation_prompt")(server, tokenizer)
        def counts(body):
            usage = ok(server, R, body)["usage"]
            return usage["input_tokens"], usage["output_tokens"]
        assert counts({"chat_template_kwargs": {}}) == counts({})

    def priority(server, tokenizer):
        """Passed to the engine under --policy priority (the same greedy text at any
        priority; the queue order: test_field_is_used_or_rejected's chat case)."""
        for prio in (-9, 9):
            assert reply(server, {"priority": prio}) == reply(server, {})
        rejected(R, {"priority": "high"}, "priority")(server, tokenizer)

    def kv_transfer_params(server, tokenizer):
        """This server has no --kv-transfer-config: chat's 400 naming it, saying why (not
        the unknown field's); null asks for nothing."""
        resp = post(server, R, {"kv_transfer_params": {"do_remote_prefill": True}})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == ("kv_transfer_params",
                                                   "unsupported_parameter"), error
        assert "runs no KV connector" in error["message"], error
        assert reply(server, {"kv_transfer_params": None}) == reply(server, {})

    def thinking_token_budget(server, tokenizer):
        """Not a field of vLLM 0.32's Responses request (its chat and completions only): a
        400 naming it that says so, not an unnamed unknown field (null asks for nothing)."""
        resp = post(server, R, {"thinking_token_budget": 4})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == ("thinking_token_budget",
                                                   "unsupported_parameter"), error
        assert "vLLM 0.32's /v1/responses does not read it" in error["message"], error
        assert reply(server, {"thinking_token_budget": None}) == reply(server, {})

    def truncation(server, tokenizer):
        """vLLM 0.32's reading of ``auto``: a conversation longer than the context keeps its
        last ``max_model_len - 1`` tokens (the context from /v1/models), one left for the
        reply (cut there: ``incomplete``); ``disabled`` (the default) refuses it."""
        models = httpx.get(f"{server.url}/v1/models", timeout=60).json()
        max_model_len = models["data"][0]["max_model_len"]
        long = {"input": "the quick brown fox " * max_model_len}
        assert post(server, R, long).status_code == 400
        assert post(server, R, {**long, "truncation": "disabled"}).status_code == 400
        out = ok(server, R, {**long, "truncation": "auto"})
        assert (out["usage"]["input_tokens"], out["usage"]["output_tokens"], out["status"],
                out["truncation"]) == (max_model_len - 1, 1, "incomplete", "auto")
        rejected(R, {"truncation": "sometimes"}, "truncation")(server, tokenizer)

    def request_id(server, tokenizer):
        """vLLM 0.32's: the response's id as sent (not prefixed, unlike chat's), which GET
        /v1/responses/{id} answers with the same reply; without it ``resp_`` and 32 hex; an
        empty one is a 400 naming it."""
        sent = ok(server, R, {"max_output_tokens": 16, "request_id": "trace-r42"})
        assert sent["id"] == "trace-r42" and output_text(sent) == greedy(server)
        got = httpx.get(f"{server.url}{R}/trace-r42", timeout=60)
        assert got.status_code == 200 and got.json() == sent
        assert re.fullmatch("resp_[0-9a-f]{32}", ok(server, R, {})["id"])
        rejected(R, {"request_id": ""}, "request_id")(server, tokenizer)

    return {"top_k": filter_restores_greedy("top_k", 1),
            "min_p": filter_restores_greedy("min_p", 1.0),
            "presence_penalty": penalty("presence_penalty", 2.0),
            "frequency_penalty": penalty("frequency_penalty", 2.0),
            "repetition_penalty": penalty("repetition_penalty", 3.0),
            "seed": seed, "stop": stop, "stop_token_ids": stop_token_ids,
            "ignore_eos": ignore_eos, "logit_bias": logit_bias,
            "skip_special_tokens": skip_special_tokens,
            "include_stop_str_in_output": include_stop_str_in_output,
            "structured_outputs": structured_outputs,
            "chat_template_kwargs": chat_template_kwargs, "priority": priority,
            "kv_transfer_params": kv_transfer_params,
            "thinking_token_budget": thinking_token_budget, "truncation": truncation,
            "request_id": request_id}


RESPONSES_CASES = responses_cases()


def test_every_responses_chat_field_has_a_case():
    from kvflow.entrypoints.protocol.responses_api import CHAT_FIELDS, ResponsesRequest

    assert set(RESPONSES_CASES) == {*CHAT_FIELDS, "thinking_token_budget", "truncation",
                                    "request_id"}
    assert set(CHAT_FIELDS) <= set(ResponsesRequest.model_fields)


@pytest.mark.parametrize("field", RESPONSES_CASES)
def test_responses_field_is_used_or_rejected(server, tokenizer, field):
    failure = oracle_failure(RESPONSES_CASES[field], server, tokenizer)
    assert failure is None, f"{R} {field!r}: neither honoured nor rejected: {failure}"


CASES = {C: (protocol.CompletionRequest, completion_cases()),
         CH: (protocol.ChatCompletionRequest, chat_cases()),
         TOK: (protocol.TokenizeRequest, tokenize_cases()),
         DETOK: (protocol.DetokenizeRequest, detokenize_cases()),
         LOAD: (protocol.LoadLoRAAdapterRequest, lora_cases()[LOAD]),
         UNLOAD: (protocol.UnloadLoRAAdapterRequest, lora_cases()[UNLOAD]),
         EMB: (protocol.EmbeddingRequest, embedding_cases())}


def test_every_field_has_a_case():
    for path, (model, cases) in CASES.items():
        assert set(cases) == set(model.model_fields), path


def oracle_failure(case: Callable, server, tokenizer) -> str | None:
    """Run one field's case: None when the server's answers matched the case's oracle (a
    baseline request, the tokenizer, the chat template, a hand-computed value) or it refused
    the field with the expected status naming it; else what did not match."""
    try:
        case(server, tokenizer)
    except AssertionError as e:
        return str(e) or "an assertion failed"
    return None


def test_oracle_failure_reports_a_mismatch():
    """The check above can fail: a case whose answer differs from its oracle is reported."""
    def wrong(server, tokenizer):
        assert [1, 2] == [1, 3], "greedy ids differ"

    assert "greedy ids differ" in oracle_failure(wrong, None, None)
    assert oracle_failure(lambda server, tokenizer: None, None, None) is None


@pytest.mark.parametrize("path,field", [(p, f) for p, (_, cases) in CASES.items()
                                        for f in cases])
def test_field_is_used_or_rejected(request, tokenizer, path, field):
    server = request.getfixturevalue("embed_server" if path == EMB else "server")
    assert oracle_failure(CASES[path][1][field], server, tokenizer) is None, \
        f"{path} {field!r}: neither honoured nor rejected"


# ---- text checks and fields kvflow does not implement ----------------------------------------
FULL_BODIES = {
    C: {"prompt": ["abc", "def"], "stop": ["x", "y"], "user": "u", "model": "m",
        "logit_bias": {"5": 1}, "guided_regex": "[a-z]+"},
    CH: {"messages": [{"role": "system", "content": "s"},
                      {"role": "user", "content": [{"type": "text", "text": "p"}]},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "c1", "type": "function",
                           "function": {"name": "get_x", "arguments": "{}"}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "12:00"}],
         "tools": [TOOL], "chat_template": "{{ messages }}", "stop": "z",
         "chat_template_kwargs": {"k": "v"}, "documents": [{"text": "d"}],
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": "n", "schema": {"enum": ["a"]}}}},
    TOK: {"messages": HI, "chat_template": "t"},
    DETOK: {"model": "m", "tokens": [1]},
}


def string_paths(value: Any, path: str = "") -> list[tuple[str, ...]]:
    """Every path to a string leaf (or dict key) of a JSON value."""
    if isinstance(value, str):
        return [tuple(path.split(".")[1:])]
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    out = []
    for key, item in items:
        out += string_paths(item, f"{path}.{key}")
    return out


def with_surrogate(body: Any, path: tuple[str, ...]) -> Any:
    if not path:
        return body[:1] + "\ud800" + body[1:]
    if isinstance(body, list):
        i = int(path[0])
        return [with_surrogate(v, path[1:]) if j == i else v for j, v in enumerate(body)]
    return {k: with_surrogate(v, path[1:]) if k == path[0] else v for k, v in body.items()}


@pytest.mark.parametrize("path", [C, CH, TOK, DETOK])
def test_lone_surrogate_anywhere_is_a_400(server, path):
    """Each string of a body holding every kind of text field, in turn, gets a lone
    surrogate: 400 naming that string (streaming too); never a 5xx."""
    for leaf in string_paths(FULL_BODIES[path]):
        for stream in ((False, True) if path in (C, CH) else (False,)):
            body = with_surrogate(FULL_BODIES[path], leaf)
            if path in (C, CH):
                body["stream"] = stream
            raw = json.dumps(body).encode()  # ensure_ascii: the surrogate as a \\ud800 escape
            resp = httpx.post(f"{server.url}{path}", content=raw, timeout=60,
                              headers={"Content-Type": "application/json"})
            assert resp.status_code == 400, (leaf, resp.text)
            error = resp.json()["error"]
            assert (error["param"], error["code"]) == (".".join(leaf), "invalid_unicode")


# An assistant's tool_calls and a tool turn's tool_call_id, rendered the transformers way
# (arguments an object; "| tojson" of JSON text would give a quoted string instead).
CALL = {"id": "c1", "type": "function", "function": {"name": "get_x", "arguments": '{"x": 1}'}}
TOOL_TURNS = [*HI, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
CALLS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
    "[{{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}")


@pytest.mark.parametrize("field,value", [
    ("add_generation_prompt", False), ("continue_final_message", True),
    ("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"x": 1}),
    ("tools", [TOOL]), ("tool_choice", "none"), ("documents", [{"text": "d"}])])
def test_tokenize_prompt_refuses_chat_options(server, tokenizer, field, value):
    """/tokenize of a ``prompt`` renders no template: a chat option set to anything but its
    default was silently ignored (the prompt's ids came back); now a 400 naming it. Its
    default passes and gives the tokenizer's ids."""
    resp = post(server, TOK, {field: value})
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        (field, "invalid_value")
    default = protocol.TokenizeRequest.model_fields[field].default
    assert ok(server, TOK, {field: default})["tokens"] == tokenizer.encode(PROMPT)


@pytest.mark.parametrize("path", [CH, TOK])
def test_history_tool_calls_reach_the_template(server, tokenizer, path):
    """A template that renders tool_calls gets each call with its arguments as an object, and
    the tool turn's tool_call_id (oracle: the HF tokenizer's rendering of the turns with the
    arguments parsed, as transformers' tool-use docs write them); one that reads tools but no
    tool_calls is a 400 naming the turn's tool_calls (it could not show them)."""
    parsed = {**CALL, "function": {"name": "get_x", "arguments": {"x": 1}}}
    hf_turns = [*HI, {**TOOL_TURNS[1], "tool_calls": [parsed]}, TOOL_TURNS[2]]
    expected = tokenizer.encode(tokenizer.apply_chat_template(
        hf_turns, chat_template=CALLS_TEMPLATE, tokenize=False), add_special_tokens=False)
    body = {"messages": TOOL_TURNS, "chat_template": CALLS_TEMPLATE}
    if path == CH:
        assert prompt_ids(server, body) == expected
    else:
        assert ok(server, TOK, {"prompt": None, **body})["tokens"] == expected
    reads_tools = "{% for t in tools or [] %}{{ t }}{% endfor %}{{ messages[0].content }}"
    refused = {"messages": TOOL_TURNS, "chat_template": reads_tools}
    resp = post(server, path, {"prompt": None, **refused} if path == TOK else refused)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages.1.tool_calls"


NO_SYSTEM_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}"
                      "<{{ m.role }}>{{ m.content }}\n{% endfor %}")


@pytest.mark.parametrize("path", [CH, TOK])
def test_tools_system_message_a_template_refuses_is_a_400_at_tools(server, path):
    """Tools on a template that reads neither tools nor tool_calls and refuses a system role
    (Mistral's do): kvflow's system message for the tools fails to render. A 400 at
    ``tools`` saying kvflow added it, with the template's own words (hand-written oracle),
    never a 5xx; without tools the same request renders."""
    body = {"messages": HI, "chat_template": NO_SYSTEM_TEMPLATE, "tools": [TOOL]}
    resp = post(server, path, {"prompt": None, **body} if path == TOK else body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"], error["type"]) == \
        ("tools", "invalid_value", "invalid_request_error")
    assert error["message"] == (
        "the chat template cannot render message 0 (a system message) that kvflow added for "
        "tools: this template does not read tools, so kvflow writes their instructions into "
        "the system message, and the template fails on it (TemplateError: System role not "
        "supported); send the request without tools, or use a chat template that reads tools")
    without = {k: v for k, v in body.items() if k != "tools"}
    ok(server, path, {"prompt": None, **without} if path == TOK else without)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "ping"}}],
                         ids=["required", "named"])
def test_forced_call_of_a_tool_without_parameters_has_no_arguments(server, tokenizer, choice):
    """A tool without ``parameters`` takes none (OpenAI's rule): a forced call's arguments are
    "{}" even with a bias towards '"' that makes the model write keys wherever the grammar lets
    it (before, the any-object grammar let it make arguments up)."""
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    body = {**HOT, "max_tokens": 40, "tools": [{"type": "function",
                                                "function": {"name": "ping"}}],
            "tool_choice": choice, "chat_template": TOOLS_TEMPLATE,
            "parallel_tool_calls": False, "logit_bias": {str(quote): 30}}
    choice_out = ok(server, CH, body)["choices"][0]
    # OpenAI's finish reasons: tool_calls under required, stop under a named function
    assert choice_out["finish_reason"] == ("stop" if isinstance(choice, dict) else "tool_calls"), \
        choice_out
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in choice_out["message"]["tool_calls"]] == [("ping", "{}")]


def test_tokenize_counts_what_embeddings_embed(embed_server, tiny_tokenizer, built_models):
    """/tokenize on an embedding server gives the ids /v1/embeddings feeds the model: after
    the default prompt, lower-cased (oracle: sentence-transformers' own tokenization of the
    prompted text; it gave the raw text's ids, 12 where 8 were embedded, before)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(_embed_model(tiny_tokenizer, built_models), device="cpu")
    text = "The QUICK Brown fox"
    expected = st.tokenize([st.prompts[st.default_prompt_name] + text])["input_ids"][0]
    assert ok(embed_server, TOK, {"prompt": text})["tokens"] == expected.tolist()
    usage = ok(embed_server, EMB, {"input": text})["usage"]
    assert usage["prompt_tokens"] == len(expected)


def test_continue_final_message_alone_says_the_default(server):
    """``continue_final_message: true`` alone: add_generation_prompt defaults to true, and the
    400 says so and what to send (it said only that both cannot be true)."""
    messages = [*HI, {"role": "assistant", "content": "The"}]
    resp = post(server, CH, {"messages": messages, "continue_final_message": True,
                             "max_tokens": 1})
    assert (resp.status_code, resp.json()["error"]) == (400, {
        "message": "continue_final_message and add_generation_prompt cannot both be true; "
                   "add_generation_prompt defaults to true, so send it as false with "
                   "continue_final_message",
        "type": "invalid_request_error", "param": "continue_final_message",
        "code": "invalid_value"})
    ok(server, CH, {"messages": messages, "continue_final_message": True,
                    "add_generation_prompt": False, "max_tokens": 1})


def test_empty_model_names_the_served_model_without_lora(server, embed_server,
                                                         tiny_tokenizer, built_models):
    """``"model": ""``: without --enable-lora (the embedding server) the 400 says the name is
    empty and names the served model (it spoke of LoRA adapters' names); with it, the rule
    for adapter names."""
    served = _embed_model(tiny_tokenizer, built_models)
    resp = post(embed_server, EMB, {"model": "", "input": "a"})
    assert (resp.status_code, resp.json()["error"]) == (400, {
        "message": f"model '' is empty: send the served model's name, {served!r} (or leave "
                   "model out)",
        "type": "invalid_request_error", "param": "model", "code": "invalid_value"})
    resp = post(server, CH, {"model": " ", "messages": HI})
    assert (resp.status_code, resp.json()["error"]["message"]) == (400, (
        "model ' ' is whitespace only: a LoRA adapter's name must hold visible characters and "
        "no control characters"))


def test_detokenize_out_of_vocabulary_names_the_index(server, tokenizer):
    """A token id outside the vocabulary: param ``tokens.N`` (N its index), as the schema's
    type errors say ``tokens.0`` (it was ``tokens``)."""
    vocab = len(tokenizer)
    resp = post(server, DETOK, {"tokens": [5, 6, vocab, -1]})
    assert (resp.status_code, resp.json()["error"]) == (400, {
        "message": f"tokens.2: token id {vocab} is outside the vocabulary [0, {vocab})",
        "type": "invalid_request_error", "param": "tokens.2", "code": "invalid_value"})


@pytest.mark.parametrize("prompt,where,bad", [
    (lambda v: [5, 6, v, -1], "prompt.2", "V"),  # one prompt of token ids: the id's index
    (lambda v: [[5, 6], [8], [7, -1, v]], "prompt.2.1", -1),  # the prompt's, then the id's
])
def test_completion_out_of_vocabulary_names_the_index(server, tokenizer, prompt, where, bad):
    """A prompt token id outside the vocabulary is named by its path, as /detokenize's
    ``tokens.N`` and the schema's errors for a nested list (``prompt.2.1``): a single
    prompt's bad id was ``prompt`` and a listed prompt's ``prompt.N`` without the id's
    index. The first bad id in request order is named ("V": the vocabulary size)."""
    vocab = len(tokenizer)
    bad = vocab if bad == "V" else bad
    resp = post(server, C, {"prompt": prompt(vocab), "max_tokens": 1}, base=False)
    assert (resp.status_code, resp.json()["error"]) == (400, {
        "message": f"{where}: token id {bad} is outside the vocabulary [0, {vocab})",
        "type": "invalid_request_error", "param": where, "code": "invalid_value"})


def test_too_many_stop_strings_is_array_above_max_length(server):
    """129 stop strings: code ``array_above_max_length``, as other too-long arrays (it was
    ``invalid_value``)."""
    resp = post(server, CH, {"messages": HI, "stop": [f"s{i}" for i in range(129)]})
    assert (resp.status_code, resp.json()["error"]) == (400, {
        "message": "stop holds 129 strings: at most 128 stop strings are accepted per request",
        "type": "invalid_request_error", "param": "stop", "code": "array_above_max_length"})


def test_retrieve_model(server, model_dir):
    """GET /v1/models/{model}, OpenAI's retrieve-model as the openai client calls it (it was
    a 404 for every name): the served model's card, a name with slashes included (here the
    model's path); an unknown name is a 404 model_not_found."""
    import openai

    client = server.client()
    card = client.models.retrieve(model_dir)
    assert (card.id, card.object, card.owned_by) == (model_dir, "model", "kvflow")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found"


@pytest.mark.parametrize("path,field", [(C, "max_tokens"), (CH, "max_tokens"),
                                        (CH, "max_completion_tokens")])
def test_max_tokens_below_one_names_the_field(server, path, field):
    """A 400 whose param is the field the request set and whose code is OpenAI's
    ``integer_below_min_value``; the message names the field, not kvflow's classes."""
    for value in (0, -3):  # chat's max_completion_tokens alone (max_tokens unset)
        resp = post(server, path, {"max_tokens": None, field: value})
        error = resp.json()["error"]
        assert resp.status_code == 400, resp.text
        assert (error["param"], error["code"]) == (field, "integer_below_min_value")
        assert error["message"].startswith(f"{field}={value} is invalid")


def test_max_tokens_and_max_completion_tokens_together(server):
    """Both chat length fields with different values: max_completion_tokens won and
    max_tokens was dropped unread (vLLM's rule; 200 with 3 tokens here); OpenAI refuses the
    pair. Now a 400 naming both (code ``invalid_parameter_combination``, param ``max_tokens``
    as OpenAI's); the same value in both is honoured (3 tokens), and the server keeps
    serving."""
    resp = post(server, CH, {"max_tokens": 8, "max_completion_tokens": 3})
    error = resp.json()["error"]
    assert resp.status_code == 400, resp.text
    assert (error["param"], error["code"]) == ("max_tokens", "invalid_parameter_combination")
    assert error["message"].startswith("max_tokens=8 and max_completion_tokens=3 set "
                                       "different limits")
    for both in (3, 5):
        reply = ok(server, CH, {"max_tokens": both, "max_completion_tokens": both,
                                "ignore_eos": True})
        assert len(ids(reply)) == reply["usage"]["completion_tokens"] == both


def test_sampling_value_error_names_the_field(server):
    """A value only SamplingParams can judge (min_tokens above max_tokens) is a 400 naming
    the request field, with code ``invalid_value``, and no internal class name."""
    resp = post(server, C, {"min_tokens": 5, "max_tokens": 3})
    error = resp.json()["error"]
    assert resp.status_code == 400, resp.text
    assert (error["param"], error["code"]) == ("min_tokens", "invalid_value")
    assert error["message"] == "min_tokens=5 is invalid: it must be <= max_tokens (3)"


@pytest.mark.parametrize("body,param,code", [
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"max_tokens": 10**12}, "max_tokens", "integer_above_max_value"),
    ({"temperature": -1.5}, "temperature", "decimal_below_min_value"),
    ({"top_p": 2.0}, "top_p", "decimal_above_max_value"),
])
def test_schema_errors_carry_openai_codes(server, body, param, code):
    """A body the request schema refuses (wrong type, number out of range) is a 400 whose
    code is OpenAI's for that error (``invalid_type``, ``integer_above_max_value``, ...),
    not null; an empty body is ``invalid_json``."""
    resp = post(server, C, body)
    error = resp.json()["error"]
    assert resp.status_code == 400, resp.text
    assert (error["param"], error["code"]) == (param, code)
    empty = httpx.post(f"{server.url}/v1/completions", content=b"",
                       headers={"Content-Type": "application/json"}, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("body,sent", [(b"[1, 2]", "a list"), (b'"hi"', "'hi'"),
                                       (b"7", "7"), (b"null", "null")])
def test_a_body_that_is_not_an_object_says_so(server, body, sent):
    """JSON that is not an object (an array, string, number or null) is a 400 saying the body
    must be an object and what it got, not pydantic's "Input should be a valid dictionary or
    object to extract fields from"."""
    resp = httpx.post(f"{server.url}{C}", content=body,
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["message"], error["code"], error["param"]) == (
        f"the request body must be a JSON object, got {sent}", "invalid_json", None)


STRICT_TYPES = [  # (path, body, param): OpenAI refuses each with code invalid_type
    (C, {"max_tokens": "8"}, "max_tokens"), (C, {"max_tokens": 8.0}, "max_tokens"),
    (C, {"n": True}, "n"), (C, {"seed": "7"}, "seed"), (C, {"temperature": "0.5"},
                                                        "temperature"),
    (C, {"temperature": False}, "temperature"), (C, {"stream": "true"}, "stream"),
    (C, {"echo": 1}, "echo"), (C, {"logprobs": "2"}, "logprobs"),
    (C, {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    (C, {"logit_bias": {"5": "1"}}, "logit_bias.5"),
    (C, {"stop_token_ids": ["5"]}, "stop_token_ids.0"),
    (C, {"structured_outputs": {"json_object": "true"}}, "structured_outputs.json_object"),
    (CH, {"max_completion_tokens": "8"}, "max_completion_tokens"),
    (CH, {"logprobs": "true"}, "logprobs"), (CH, {"top_logprobs": 2.0}, "top_logprobs"),
    (CH, {"add_generation_prompt": 0}, "add_generation_prompt"),
    (TOK, {"add_special_tokens": "false"}, "add_special_tokens"),
    (DETOK, {"tokens": ["5"]}, "tokens.0"),
]


@pytest.mark.parametrize("path,body,param", STRICT_TYPES)
def test_wrong_json_type_is_invalid_type(server, path, body, param):
    """OpenAI's schema is strict: a string, float or boolean where an integer belongs (and a
    string or number where a boolean belongs) is a 400 ``invalid_type`` naming the field, not
    coerced as pydantic's lax mode would ("8" -> 8)."""
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"], error["code"]) == \
        ("invalid_request_error", param, "invalid_type"), error


def test_strict_types_keep_integers_as_numbers(server, embed_server):
    """A JSON integer is a number: ``temperature: 1`` / ``top_p: 1`` / an integer logit bias
    are accepted and mean 1.0 (hand-computed: greedy and temperature 0.0 agree, so temperature
    0 as an integer gives the greedy ids of temperature 0.0); embeddings take only an integer
    ``dimensions``."""
    as_int = ok(server, C, {"temperature": 0, "top_p": 1, "logit_bias": {"5": 0}})
    as_float = ok(server, C, {"temperature": 0.0, "top_p": 1.0, "logit_bias": {"5": 0.0}})
    assert ids(as_int) == ids(as_float)
    assert ok(server, C, {"temperature": 1, "seed": 3})["choices"][0]["token_ids"] == \
        ok(server, C, {"temperature": 1.0, "seed": 3})["choices"][0]["token_ids"]
    resp = post(embed_server, EMB, {"dimensions": "8"})
    error = resp.json()["error"]
    assert (resp.status_code, error["param"], error["code"]) == (400, "dimensions",
                                                                 "invalid_type")
    assert len(ok(embed_server, EMB, {"dimensions": 8})["data"][0]["embedding"]) == 8


@pytest.mark.parametrize("path,body,param,code", [
    (C, {"allowed_token_ids": []}, "allowed_token_ids", "invalid_value"),
    (CH, {"allowed_token_ids": [5, 320]}, "allowed_token_ids", "invalid_value"),  # vocab 320
    (C, {"bad_words": [""]}, "bad_words", "invalid_value"),
    (CH, {"bad_words": "a"}, "bad_words", "invalid_type"),
    (C, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "invalid_value"),
    (CH, {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "invalid_value"),
    (C, {"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", "invalid_value"),
    (CH, {"return_tokens_as_token_ids": "maybe"}, "return_tokens_as_token_ids",
     "invalid_type"),
    (CH, {"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    (CH, {"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    (CH, {"media_io_kwargs": {"image": {"mode": "L"}}}, "media_io_kwargs",
     "unsupported_parameter"),
    (C, {"logit_bias": {"5": 1, "05": -1}}, "logit_bias", "invalid_value"),
    (C, {"guided_decoding_backend": "outlines", "guided_regex": "a+"},
     "guided_decoding_backend", "unsupported_parameter"),  # was ignored: xgrammar ran
    (CH, {"chat_template": " "}, "chat_template", "invalid_value"),
    (C, {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                      "schema": False}}},
     "response_format.json_schema.schema", "invalid_value"),
    (CH, {"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "banana"}}}},
     "response_format.json_schema.schema", "invalid_value"),
    (C, {"guided_json": {"type": "banana"}}, "guided_json", "invalid_value"),
    # a misspelled nested key (strict) was dropped: the schema ran as if it were not there
    (CH, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strct": True}}},
     "response_format.json_schema.strct", "unknown_parameter"),
])
def test_fields_that_would_change_the_reply_are_refused(server, path, body, param, code):
    """An OpenAI or vLLM field kvflow does not implement but that would change the reply is a
    400 naming it (not ignored and logged); a token id given twice in logit_bias, an empty
    chat template, a schema no output matches or that does not compile, an unknown key of
    a nested object, an empty or out-of-vocabulary allowed_token_ids, an empty bad word and
    a truncate_prompt_tokens of 0, below -1 or above max_model_len name their field."""
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_harmless_values_of_unsupported_fields_pass(server):
    """``modalities: ["text"]``, ``guided_decoding_backend: "xgrammar"`` and null ask for
    nothing kvflow does not do: the same greedy ids as without them."""
    plain = ids(ok(server, CH, {}))
    assert ids(ok(server, CH, {"modalities": ["text"], "audio": None,
                               "guided_decoding_backend": "xgrammar"})) == plain


def test_schema_true_allows_any_json_and_the_largest_seed_is_a_seed(server):
    """``"schema": true`` (JSON Schema: every value matches) is honoured as "any JSON" (the
    reply parses as JSON), not a 500; seed 2**63 - 1 (the largest 64-bit integer) is
    accepted and reproducible, and with n=2 its second sample is seed -2**63's first (seed + 1
    wraps modulo 2**64, as torch's generator reads seeds)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}
    reply = ok(server, C, {"response_format": fmt, "max_tokens": 24})["choices"][0]
    if reply["finish_reason"] == "stop":
        json.loads(reply["text"])
    else:  # cut at max_tokens: the text is still a prefix of JSON
        assert reply["text"].lstrip()[:1] in set('{["-0123456789tfn')
    big = {"temperature": 5.0, "max_tokens": 8, "seed": 2**63 - 1}
    first = ok(server, C, {**big, "n": 2})
    assert ids(ok(server, C, big)) == ids(first, 0)
    assert ids(ok(server, C, {**big, "seed": -2**63})) == ids(first, 1)


def test_null_means_the_default(server):
    """A field sent as null takes its default, as OpenAI's nullable fields (``n``,
    ``stream``, ``echo``, ``logprobs``) and vLLM read it: the same reply as without it; a
    required field sent as null is still a 400 naming it."""
    for path, nulls in ((C, {"n": None, "stream": None, "echo": None, "ignore_eos": None}),
                        (CH, {"n": None, "stream": None, "logprobs": None,
                              "add_generation_prompt": None})):
        plain = ok(server, path, {})
        nulled = ok(server, path, nulls)
        assert len(nulled["choices"]) == 1 and ids(nulled) == ids(plain)
    resp = post(server, CH, {"messages": None})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text


@pytest.mark.parametrize("field,value", [("cache_salt", "a")])
def test_embedding_fields_that_would_change_the_vectors_are_refused(embed_server, field, value):
    """A field /v1/embeddings does not take but another endpoint does (a prefix-cache salt)
    is a 400 naming it (it was ignored: the same vector came back); null passes.
    (vLLM's ``normalize``, ``add_special_tokens``, ``truncate_prompt_tokens``,
    ``embed_dtype``, ``endianness`` and ``priority`` are honoured: ``embedding_cases``.)"""
    resp = post(embed_server, EMB, {field: value})
    error = resp.json()["error"]
    assert resp.status_code == 400 and (error["param"], error["code"]) == \
        (field, "unsupported_parameter"), resp.text
    assert ok(embed_server, EMB, {field: None})["data"][0]["embedding"] == \
        ok(embed_server, EMB, {})["data"][0]["embedding"]
