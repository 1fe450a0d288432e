"""``collective_rpc("reload_weights")`` on an awake engine (the checkpoint read again, as
after a level-2 sleep): the prefix cache's K/V of the old weights serve no hit after it (a
changed checkpoint's greedy output is transformers' on the new files), and a reload whose
load fails leaves the engine refusing requests until one succeeds (it ran them on no model),
the server's mirror of the sleep state too. Oracle: transformers' greedy decoding of the
folder's files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvflow import LLM, SamplingParams
from kvflow.core.sleep_mode import EngineSleep
from kvflow.engine.async_llm_calls import AsyncLLMCalls
from kvflow.engine.messages import CollectiveRPC

# whole blocks of 4: the second run of a prompt hits its first blocks in the prefix cache
PROMPTS = [[5, 9, 23, 41, 7, 77, 120, 3, 64, 200, 11, 12], [150, 2, 88, 17, 240, 33, 9, 4, 1]]
MAX_TOKENS = 8


def _copy(tiny, folder: Path) -> Path:
    shutil.copytree(tiny.path, folder)
    return folder


def _engine(folder: Path) -> LLM:
    return LLM(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
               enable_prefix_caching=True)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params,
                                                                use_tqdm=False)]


def _hf_greedy(folder: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            seq = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(ids):].tolist())
    return out


def _weights_file(folder: Path) -> Path:
    (path,) = folder.glob("*.safetensors")
    return path


def test_a_changed_checkpoint_reloads_without_the_old_prefix_cache(tiny_llama, tmp_path):
    """The old K/V of the prompts' first blocks stayed indexed: the run after the reload hit
    them and decoded from the old weights' keys and values."""
    folder = _copy(tiny_llama, tmp_path / "model")
    llm = _engine(folder)
    assert _greedy(llm) == _hf_greedy(folder)
    pool = llm.engine.core.kv_cache_manager.pool
    assert len(list(pool._cached)) > 0  # the prompts' blocks are cached

    path = _weights_file(folder)
    weights = load_file(path)
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():  # every layer's keys and values: new K/V everywhere
        if "k_proj" in name or "v_proj" in name:
            weights[name] = torch.randn(w.shape, generator=gen, dtype=w.dtype) * 0.5
    save_file(weights, path, metadata={"format": "pt"})
    expected = _hf_greedy(folder)

    assert llm.collective_rpc("reload_weights") == [None]
    assert not list(pool._cached)
    assert _greedy(llm) == expected
    llm.shutdown()


def _change_kv_weights(folder: Path) -> None:
    """Replace every layer's k_proj and v_proj in the folder's checkpoint (new K/V of every
    token: the greedy tokens change, which the tests check)."""
    path = _weights_file(folder)
    weights = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if "k_proj" in name or "v_proj" in name:
            weights[name] = torch.randn(w.shape, generator=gen, dtype=w.dtype) * 0.5
    save_file(weights, path, metadata={"format": "pt"})


def test_blocks_a_running_request_holds_serve_no_hit_after_a_reload(tiny_llama, tmp_path):
    """A request running across the reload held its prompt's blocks, which kept their
    hashes: once it finished they were freed still indexed, and the same prompt after it
    hit the old weights' K/V (wrong tokens). Its blocks filled after the reload (attending
    over old K/V) must not be indexed either."""
    folder = _copy(tiny_llama, tmp_path / "model")
    llm = _engine(folder)
    old = _greedy(llm)
    kv = llm.engine.core.kv_cache_manager
    kv.reset_prefix_cache()  # nothing cached but what the running request holds
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True))
    engine.step()  # the prompt's 3 full blocks computed and indexed, held by it
    assert len(list(kv.pool._cached)) == 3

    _change_kv_weights(folder)
    expected = _hf_greedy(folder)
    assert expected != old  # by hand: the new K/V change every prompt's greedy tokens
    assert llm.collective_rpc("reload_weights") == [None]
    assert not list(kv.pool._cached)  # its held blocks are forgotten too
    while engine.has_unfinished_requests():  # 20 tokens: 2 more full blocks filled
        engine.step()
    assert not list(kv.pool._cached)  # nothing of it indexed, before or after the reload
    kv.pool.check_invariants()

    hits = kv.num_hits
    assert _greedy(llm) == expected
    assert kv.num_hits == hits  # the metric: no prefix-cache hit after the reload
    assert _greedy(llm) == expected  # the new weights' blocks are cached and served
    assert kv.num_hits > hits
    llm.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_reloads_to_a_fresh_engines_tokens(tiny_llama, tmp_path,
                                                                kv_cache_dtype):
    """--kv-cache-dtype int8 / fp8: the quantized blocks (and their scales beside them) of a
    request running across the reload serve no hit after it: the tokens are a fresh engine's
    on the new files (transformers does not quantize its cache: kvflow is the oracle)."""
    folder = _copy(tiny_llama, tmp_path / "model")

    def engine() -> LLM:
        return LLM(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64,
                   block_size=4, enable_prefix_caching=True, kv_cache_dtype=kv_cache_dtype)

    llm = engine()
    old = _greedy(llm)
    llm.engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True))
    llm.engine.step()  # its prompt's blocks, held across the reload
    _change_kv_weights(folder)
    assert llm.collective_rpc("reload_weights") == [None]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    got = _greedy(llm)
    llm.shutdown()
    fresh = engine()
    expected = _greedy(fresh)
    fresh.shutdown()
    assert expected != old  # the new K/V change the tokens
    assert got == expected


def test_new_weights_after_a_level_2_sleep_serve_no_old_block(tiny_llama, tmp_path):
    """sleep(level=2), the checkpoint rewritten, wake_up and reload_weights: the new
    weights' greedy tokens (transformers' on the new files), with no prefix-cache hit."""
    folder = _copy(tiny_llama, tmp_path / "model")
    llm = LLM(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
              enable_prefix_caching=True, enable_sleep_mode=True)
    old = _greedy(llm)
    kv = llm.engine.core.kv_cache_manager
    llm.sleep(level=2)
    _change_kv_weights(folder)
    expected = _hf_greedy(folder)
    assert expected != old
    llm.wake_up()
    assert llm.collective_rpc("reload_weights") == [None]
    hits = kv.num_hits
    assert _greedy(llm) == expected
    assert kv.num_hits == hits
    llm.shutdown()


def test_a_reload_that_fails_refuses_requests_until_one_succeeds(tiny_llama, tmp_path):
    """The runner let its model go before the load failed; the engine went on accepting
    requests and ran them on no model (TypeError: 'NoneType' object is not callable; the
    server's engine core died of it)."""
    folder = _copy(tiny_llama, tmp_path / "model")
    llm = _engine(folder)
    expected = _greedy(llm)
    path = _weights_file(folder)
    good = path.read_bytes()
    path.write_bytes(good[:len(good) // 2])  # truncated

    with pytest.raises(ValueError, match="reload_weights: ValueError: .*truncated or corrupt"):
        llm.collective_rpc("reload_weights")
    with pytest.raises(ValueError, match="reload_weights"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.collective_rpc("weight_bytes") == [0]

    path.write_bytes(good)
    assert llm.collective_rpc("reload_weights") == [None]
    assert _greedy(llm) == expected == _hf_greedy(folder)
    llm.shutdown()


def test_bad_arguments_keep_the_weights(tiny_llama):
    """A call refused before any load (an argument reload_weights does not take) leaves the
    model loaded and the engine serving."""
    llm = _engine(Path(tiny_llama.path))
    expected = _greedy(llm)
    with pytest.raises(ValueError, match="reload_weights: TypeError"):
        llm.collective_rpc("reload_weights", args=(1,))
    assert _greedy(llm) == expected
    llm.shutdown()


class _Replicas(AsyncLLMCalls):
    """``AsyncLLM``'s calls over replicas that answer ``reload_weights`` with ``reload`` (a
    refusal raises it) and ``weight_bytes`` with ``sizes`` (by replica, by rank)."""

    def __init__(self, reload: Exception | None, sizes: list[list[int]]) -> None:
        self.sleep_state = EngineSleep(True)
        self.reload, self.sizes, self.sent = reload, sizes, []

    async def _call(self, msg: CollectiveRPC) -> list:
        self.sent.append(msg.method)
        if msg.method == "reload_weights":
            if self.reload is not None:
                raise self.reload
            return [[None] for _ in self.sizes]
        return self.sizes


@pytest.mark.parametrize(("reload", "sizes", "refused"), [
    (ValueError("collective_rpc reload_weights: ValueError: truncated"), [[476416], [0]], True),
    (ValueError("collective_rpc reload_weights: TypeError: takes 1 argument"), [[476416]],
     False),
    (None, [[476416]], False),
], ids=["load-failed", "bad-arguments", "reloaded"])
def test_the_servers_mirror_refuses_requests_after_a_failed_load(reload, sizes, refused):
    """The API process refuses requests itself while the engine sleeps or lacks weights
    (503 ``engine_sleeping``); after a reload whose load failed on a replica it let them
    through to a core that had no model."""
    import asyncio

    calls = _Replicas(reload, sizes)
    if reload is None:
        assert asyncio.run(calls.collective_rpc("reload_weights")) == [[None]]
    else:
        with pytest.raises(ValueError, match="reload_weights"):
            asyncio.run(calls.collective_rpc("reload_weights"))
    refusal = calls.sleep_state.refusal()
    assert (refusal is not None) == refused
    if refused:
        assert "reload_weights whose load failed" in refusal
    assert calls.sent == ["reload_weights"] + (["weight_bytes"] if reload else [])
