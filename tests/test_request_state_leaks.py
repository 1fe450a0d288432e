"""No per-request state outlives its request: after requests end in every way a request can
end (finished, aborted before and at each step mid-stream, refused by the core, refused up
front as too long or with a bad grammar, n > 1, beam search, LoRA, structured output, stop
strings, client disconnects), no container reachable from the engine still holds their ids
(``tests/request_state.holders``: scheduler queues and dicts, KV manager and swap maps,
structured-output compiles, the model runner's request states, input batch and logits
processor rows, the output processor's states and n > 1 parents, offline stats, AsyncLLM's
streams, the server's beam searches and background runs), and every KV block is free again.

The model runner forgets a finished request when the *next* step's scheduler output names it
(``finished_req_ids``, as vLLM's runner does): an idle engine keeps its last step's finished
requests until another step runs. So each run ends with one more short request, whose own
id is not checked.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import httpx
import pytest

from kvflow import LLM, SamplingParams
from kvflow.beam_search import BeamSearchParams
from kvflow.sampling_params import RequestOutputKind
from kvflow.structured import StructuredOutputsParams
from tests.request_state import holders, wait_until_idle
from tests.test_logits_processors import BanToken

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 1, 5, 9]


def _named_ids(llm: LLM) -> set[str]:
    """Make the offline engine name its requests ``leak0``, ``leak1``, ... (ids no other
    container key can equal); returns the set the names (with their ``-i`` sample ids) are
    recorded into as they are drawn."""
    names: set[str] = set()

    def draw():
        for i in itertools.count():
            names.update([f"leak{i}", *(f"leak{i}-{j}" for j in range(4))])
            yield f"leak{i}"

    llm.engine._ids = draw()
    return names


def _flush(llm: LLM) -> None:
    """One more step's worth of work, so the runner hears of the last step's finished ones."""
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [2, 3]}, SamplingParams(max_tokens=2), "flush")
    while engine.has_unfinished_requests():
        engine.step()


def _assert_forgotten(llm: LLM, ids: set[str]) -> None:
    assert holders(llm, ids) == []
    core = llm.engine.core
    pool = core.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks
    swap = core.scheduler.swap
    if swap is not None:
        assert swap.swapped == {}
        assert swap.host.num_free_blocks == swap.host.num_blocks


CONFIGS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 3},
    "recompute": {"num_kv_blocks": 14, "max_model_len": 48},
    "swap": {"num_kv_blocks": 14, "max_model_len": 48, "preemption_mode": "swap",
             "swap_space": 0.01},
    "fair": {"scheduling_policy": "fair", "num_kv_blocks": 14, "max_model_len": 48},
    "slo": {"target_ttft_ms": 50, "target_tpot_ms": 20},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
    "draft_model": {"speculative_config": "draft_model"},  # the tiny Llama drafting itself
    "eagle": {"speculative_config": "eagle"},  # a random EAGLE-1 head
    "logits_processor": {"logits_processors": [BanToken]},
    "async": {"async_scheduling": True, "max_num_batched_tokens": 8},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_aborts_at_every_step_leave_nothing(tiny_llama, tmp_path, name):
    """Four requests (greedy, n=3 sampled with logprobs, a regex, prompt logprobs) from two
    clients, aborted after 0, 1, ... 7 steps (one left to finish every other round), with
    preemption (by recompute or swap), the fair policy, TTFT/TPOT targets,
    n-gram, draft-model or EAGLE drafts, a custom logits processor or async scheduling."""
    kw = {"num_kv_blocks": 64, "max_model_len": 64, **CONFIGS[name]}
    if kw.get("speculative_config") == "draft_model":
        kw["speculative_config"] = {"method": "draft_model", "model": tiny_llama.path,
                                    "num_speculative_tokens": 2, "quantization": "none"}
    elif kw.get("speculative_config") == "eagle":
        from tests.spec_decode.test_eagle_engine import _save_head

        _save_head(str(tmp_path), tiny_llama.path, seed=7)
        kw["speculative_config"] = {"method": "eagle", "model": str(tmp_path),
                                    "num_speculative_tokens": 2}
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=4,
              enable_prefix_caching=True, disable_log_stats=False, **kw)
    ids = _named_ids(llm)
    extra = {"extra_args": {"ban_token": 7}} if name == "logits_processor" else {}
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **extra),
        SamplingParams(temperature=1, seed=3, max_tokens=30, ignore_eos=True, n=3,
                       logprobs=1, **extra),
        SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(
            regex="[ab]{20}")),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2),
    ]
    engine = llm.engine
    for steps in range(8):
        batch = [engine.add_request({"prompt_token_ids": PROMPT}, p, client_id=f"user{i % 2}")
                 for i, p in enumerate(params)]
        for _ in range(steps):
            engine.step()
        for rid in batch[:len(batch) - steps % 2]:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    if name in ("recompute", "swap", "fair"):
        assert engine.core.scheduler.num_preemptions > 0
    _flush(llm)
    _assert_forgotten(llm, ids)


@pytest.mark.timeout(300)
def test_offline_api_mix_leaves_nothing(tiny_llama, tmp_path):
    """LLM.generate (n=1, n=3, LoRA, regex, stop strings), beam search, a prompt too long, a
    bad grammar, and a request the core refuses (its regex can start with none of its
    allowed_token_ids)."""
    from kvflow.engine.streams import RequestRefused
    from kvflow.lora.request import LoRARequest
    from tests.lora.adapters import make_adapter

    adapter = make_adapter(tiny_llama.path, str(tmp_path / "a"), 1, r=8, lora_alpha=16,
                           target_modules=["q_proj", "v_proj"])
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=4,
              max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8,
              disable_log_stats=False)
    ids = _named_ids(llm)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT}
    llm.generate([prompt, {"prompt_token_ids": PROMPT[:5]}], greedy, use_tqdm=False)
    llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5,
                                          logprobs=2, prompt_logprobs=1), use_tqdm=False)
    llm.generate([prompt], greedy, lora_request=LoRARequest("a", 1, adapter), use_tqdm=False)
    llm.generate([prompt], SamplingParams(max_tokens=8, structured_outputs=(
        StructuredOutputsParams(regex="[ab]{3}"))), use_tqdm=False)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=["a", "e", "o"]),
                 use_tqdm=False)
    llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": list(range(2, 100))}], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="grammar"):
        llm.generate([prompt], SamplingParams(max_tokens=4, structured_outputs=(
            StructuredOutputsParams(grammar="root ::= foo"))), use_tqdm=False)
    with pytest.raises(RequestRefused, match="allowed_token_ids"):
        llm.generate([prompt], SamplingParams(max_tokens=4, n=2, allowed_token_ids=[5],
                                              structured_outputs=StructuredOutputsParams(
                                                  regex="abc")), use_tqdm=False)
    _flush(llm)
    assert llm.engine.core.loras.keys() == {1}  # loaded adapters stay (vLLM's rule)
    _assert_forgotten(llm, ids)




async def _async_mix(engine) -> list[str]:
    """Requests read to their end, aborted by another task (each output kind), dropped by
    their reader (generator closed, task cancelled), refused by the core and up front;
    returns their ids."""
    from kvflow.engine.async_llm import collect

    greedy = {"temperature": 0, "ignore_eos": True}
    await collect(engine.add_request("fin", None, PROMPT, SamplingParams(max_tokens=4, **greedy)))
    await collect(engine.add_request("fin_n", None, PROMPT, SamplingParams(max_tokens=4, n=2,
                                                                           **greedy)))
    await collect(engine.add_request("stop", None, PROMPT, SamplingParams(
        temperature=0, max_tokens=30, stop=["a", "e", "o", "t"])))
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                 RequestOutputKind.FINAL_ONLY):
        stream = engine.add_request(f"abort_{kind.name}", None, PROMPT, SamplingParams(
            max_tokens=100, n=2, output_kind=kind, **greedy))
        if kind is not RequestOutputKind.FINAL_ONLY:
            await stream.__anext__()
        engine.abort(f"abort_{kind.name}")
    for n in (1, 2):
        gen = engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(
            max_tokens=100, n=n, **greedy), f"closed{n}")
        await gen.__anext__()
        await gen.aclose()

    first = asyncio.Event()

    async def read_all():
        async for _ in engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(
                max_tokens=40, **greedy), "cancelled"):
            first.set()

    task = asyncio.ensure_future(read_all())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too_long", None, list(range(2, 100)), SamplingParams(max_tokens=4))
    from kvflow.engine.streams import RequestRefused
    with pytest.raises(RequestRefused):
        await collect(engine.add_request("refused", None, PROMPT, SamplingParams(
            max_tokens=4, n=2, allowed_token_ids=[5],
            structured_outputs=StructuredOutputsParams(regex="abc"))))
    return ["fin", "fin_n", "stop", *(f"abort_{k.name}" for k in RequestOutputKind),
            "closed1", "closed2", "cancelled", "too_long", "refused"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream_interval", [1, 3])
def test_async_llm_mix_leaves_nothing(tiny_llama, stream_interval):
    """AsyncLLM's streams, output processor, stats tracker and load balancer forget every
    request; the core frees every block (its own containers are the offline engine's,
    checked above)."""
    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig.from_kwargs(
        model=tiny_llama.path, dtype="float32", num_kv_blocks=48, block_size=4,
        max_model_len=64, stream_interval=stream_interval))

    async def scenario():
        await engine.start()
        try:
            ids = await _async_mix(engine)
            await wait_until_idle(engine)
            return ids
        finally:
            await engine.shutdown()

    try:
        ids = asyncio.run(scenario())
    finally:
        engine.close()
    samples = {f"{rid}-{i}" for rid in ids for i in range(2)}
    assert holders(engine, [*ids, *samples]) == []


def _serve_in_thread(model: str, *argv: str):
    """``kvflow serve`` in this process: the app and uvicorn on a thread of their own (so
    that ``app.state`` can be walked here); returns (app, server, thread, base url)."""
    import uvicorn

    from kvflow.config import EngineConfig, ServerConfig
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.entrypoints.api_server import build_app, start_app
    from kvflow.entrypoints.cli import build_parser
    from kvflow.metrics.server import ServerMetrics
    from tests.e2e.conftest import free_port

    port = free_port()
    config = ServerConfig.from_cli_args(build_parser().parse_args(
        ["serve", model, "--port", str(port), *argv]), env={})
    engine = AsyncLLM(EngineConfig.from_kwargs(model=model, dtype="float32", num_kv_blocks=64,
                                               block_size=4, max_model_len=64),
                      ServerMetrics("m"))
    app = build_app(engine, config, "m")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))

    async def serve():
        await start_app(app)
        await server.serve()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return app, server, thread, f"http://127.0.0.1:{port}"


def _disconnect_after_first_event(client: httpx.Client, path: str, body: dict) -> None:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data"):
                break


def _http_mix(client: httpx.Client, url: str) -> None:
    """Each endpoint's requests finished, streamed and left after the first event, left
    before the answer (non-streaming), refused (too long, a bad grammar, by the core), beam
    search, stored and background responses."""
    cp = {"model": "m", "prompt": "the quick brown", "max_tokens": 5, "temperature": 0}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    ok = [("/v1/completions", cp), ("/v1/completions", {**cp, "n": 2, "logprobs": 2}),
          ("/v1/completions", {**cp, "n": 2, "use_beam_search": True}),
          ("/v1/completions", {**cp, "guided_regex": "[ab]{3}"}),
          ("/v1/chat/completions", chat),
          ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}),
          ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 5}),
          ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 5,
                             "background": True})]
    for path, body in ok:
        assert client.post(path, json=body).status_code == 200
    for body in ({**cp, "prompt": "x " * 100}, {**cp, "guided_grammar": "root ::= foo"},
                 {**cp, "n": 2, "allowed_token_ids": [5], "guided_regex": "abc"}):
        assert client.post("/v1/completions", json=body).status_code == 400
    long = {"max_tokens": 40, "ignore_eos": True, "stream": True}
    for path, body in [("/v1/completions", {**cp, **long}),
                       ("/v1/completions", {**cp, **long, "n": 2}),
                       ("/v1/completions", {**cp, **long, "n": 2, "use_beam_search": True}),
                       ("/v1/chat/completions", {**chat, **long}),
                       ("/v1/responses", {"model": "m", "input": "hi", "stream": True,
                                          "max_output_tokens": 40})]:
        _disconnect_after_first_event(client, path, body)
    for body in ({**cp, "max_tokens": 40, "ignore_eos": True, "n": 2},
                 {**cp, "max_tokens": 40, "ignore_eos": True, "n": 3, "use_beam_search": True}):
        try:  # the client leaves before the reply (unless a fast machine answers first)
            httpx.post(url + "/v1/completions", json=body, timeout=0.02)
        except httpx.TimeoutException:
            pass


@pytest.mark.timeout(300)
def test_server_mix_leaves_nothing(tiny_chat_model):
    """The server's per-request maps (beam searches, background runs and their outputs)
    and its AsyncLLM forget every request; the Responses store keeps what it stored
    (bounded: --responses-store-size) and holds none of them running."""
    app, server, thread, url = _serve_in_thread(tiny_chat_model)
    engine = app.state.engine
    ids: list[str] = []
    add_request = engine.add_request

    def recorded(request_id, *args, **kwargs):
        ids.append(request_id)
        return add_request(request_id, *args, **kwargs)

    engine.add_request = recorded
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            _http_mix(client, url)
        samples = [f"{rid}-{i}" for rid in ids for i in range(3)]
        left: list = ["(never walked)"]
        for _ in range(200):  # the server hears of the clients that left, the core ends theirs
            try:
                left = holders(app.state._state, [*ids, *samples])
            except RuntimeError:  # a set changed size while it was copied: look again
                continue
            stats = engine.stats[0]
            if not left and (stats.num_running, stats.num_waiting, stats.num_free_blocks) == \
                    (0, 0, stats.num_usable_blocks):
                break
            time.sleep(0.05)
        assert left == [], "\n".join(map(str, left))
        assert stats.num_free_blocks == stats.num_usable_blocks
        assert len(ids) > 20
        store = app.state.responses.store  # the stored replies stay (bounded), none held
        assert store.num_held == 0 and 2 <= len(store) <= 3  # the one left mid-stream may be
    finally:
        server.should_exit = True
        thread.join(60)
        engine.close()


@pytest.mark.timeout(120)
def test_a_request_aborted_while_its_grammar_compiles_is_forgotten_at_once(tiny_llama,
                                                                           monkeypatch):
    """n=2 samples whose grammar compile blocks, aborted before it ends, on an engine that
    then idles: nothing holds them but the finished-ids notice of the next step, the
    structured-output manager included (was: its
    compile and first-step check maps kept them until the compile ended and another step
    ran). The compile still ends and is cached: a later request of the grammar reuses it."""
    import threading

    from kvflow.structured.xgrammar_backend import XgrammarBackend

    release, compile_ = threading.Event(), XgrammarBackend.compile
    slow = 'root ::= "slow" [a-z]*'

    def compile_blocking(self, params):
        if params.grammar == slow:
            release.wait(20)
        return compile_(self, params)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_blocking)
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=32, block_size=4)
    ids = _named_ids(llm)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, n=2, structured_outputs=StructuredOutputsParams(
        grammar=slow))
    try:
        rid = engine.add_request({"prompt_token_ids": PROMPT}, params)
        engine.step()  # nothing to run: the samples wait for their grammar
        engine.abort_request(rid)
        assert not engine.has_unfinished_requests()
        # only the notice for the runner that the next step sends (see the module's doc)
        assert [path for path, _ in holders(llm, ids)] == ["root.engine.core.scheduler._finished_ids"]
    finally:
        release.set()
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert all(c.text.startswith("slow") or "slow".startswith(c.text) for c in out.outputs)
    _flush(llm)
    _assert_forgotten(llm, ids)
