"""``--swap-space`` sizes the host pool of ``--preemption-mode swap``; with ``recompute`` (the
default) there is no pool, so any size given is refused, naming both flags, instead of being
ignored: the default's size too (4GiB, or vLLM's ``--swap-space 4``), since the field's default
is None ("the documented default") and an explicit value is told apart from it. A bare number
is GiB, as vLLM reads it."""

from __future__ import annotations

import argparse

import pytest

from kvflow.config import EngineConfig


# the default's size (4GiB, vLLM's bare 4) too: given, it is read no more than any other
@pytest.mark.parametrize("swap_space", ["1MiB", "8GiB", 8, "8", 0.5, "4GiB", "4096MiB", 4, "4"])
def test_a_pool_size_without_swap_preemption_is_refused(swap_space):
    with pytest.raises(ValueError, match=rf"^--swap-space {swap_space} \(swap_space\) sizes the "
                                         r"host pool of --preemption-mode swap, and this engine "
                                         r"preempts by recompute, which keeps none: add "
                                         r"--preemption-mode swap .*, or leave --swap-space out$"):
        EngineConfig.from_kwargs(swap_space=swap_space)


def test_left_out_it_passes_with_recompute_and_swap_gets_4gib():
    assert EngineConfig.from_kwargs().cache_config.swap_space is None
    swap = EngineConfig.from_kwargs(preemption_mode="swap").cache_config
    assert (swap.swap_space, swap.swap_space_bytes) == (None, 4 * 2**30)


def test_the_cli_tells_the_flag_from_its_default():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args([])).cache_config.swap_space is None
    with pytest.raises(ValueError, match=r"^--swap-space 4GiB \(swap_space\) sizes the host "):
        EngineConfig.from_cli_args(parser.parse_args(["--swap-space", "4GiB"]))
    args = parser.parse_args(["--swap-space", "4", "--preemption-mode", "swap"])
    assert EngineConfig.from_cli_args(args).cache_config.swap_space_bytes == 4 * 2**30


def test_swap_preemption_takes_any_size():
    config = EngineConfig.from_kwargs(swap_space="1MiB", preemption_mode="swap")
    assert config.cache_config.swap_space == "1MiB"


@pytest.mark.parametrize(("swap_space", "expected"), [
    (8, 8 * 2**30), ("8", 8 * 2**30), (0.5, 2**29), (".25", 2**28),  # GiB, as vLLM
    ("4 GiB", 4 * 2**30), (4.0, 4 * 2**30), (" 4.0 ", 4 * 2**30),
    ("8GiB", 8 * 2**30), ("512MiB", 2**29), ("1GB", 10**9), ("1048576B", 2**20)])
def test_swap_space_bytes(swap_space, expected):
    config = EngineConfig.from_kwargs(swap_space=swap_space, preemption_mode="swap")
    assert config.cache_config.swap_space_bytes == expected


@pytest.mark.parametrize("swap_space", [0, "0", "-1", "x", "nan", "4 GiBs"])
def test_bad_swap_space_is_refused(swap_space):
    with pytest.raises(ValueError, match=rf"memory size {swap_space!r}"):
        EngineConfig.from_kwargs(swap_space=swap_space, preemption_mode="swap")


def _hf_greedy(tiny, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                     eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engines_without_the_flag_start_and_generate_as_transformers(tiny_llama, mode):
    """Left out, --swap-space is 4GiB under swap preemption (that pool's blocks) and nothing
    under recompute; either engine generates transformers' greedy tokens."""
    from kvflow import LLM, SamplingParams

    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=32, preemption_mode=mode)
    ids = [5, 17, 42, 8, 99, 3]
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert list(out) == _hf_greedy(tiny_llama, ids, 12)
    kv = llm.engine.core.kv_cache_config
    assert kv.num_host_blocks == (4 * 2**30 // kv.page_size_bytes if mode == "swap" else 0)
