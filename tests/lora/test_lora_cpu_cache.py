"""``max_cpu_loras`` (vLLM's name): at most that many LoRA adapters are kept in host memory;
the least recently used one no request holds is dropped and read again from its folder when
asked for. Counted as the runner's LoRAManager copies (not RSS); every output against
transformers + peft."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import LoRAConfig
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import MAX_TOKENS, PROMPTS, make_adapter, peft_greedy

PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TARGETS = [["q_proj", "v_proj"], ["k_proj", "o_proj"], ["gate_proj", "down_proj"],
           ["up_proj", "q_proj"]]


@pytest.fixture(scope="module")
def four(tiny_llama, tmp_path_factory) -> list[str]:
    """Four adapters, each on other modules (their tokens differ from each other's)."""
    root = tmp_path_factory.mktemp("cpu_loras")
    return [make_adapter(tiny_llama.path, str(root / f"a{i}"), 10 + i, r=4, lora_alpha=8,
                         target_modules=targets) for i, targets in enumerate(TARGETS)]


def _llm(tiny_llama, **lora: Any) -> LLM:
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
               block_size=4, enable_lora=True, max_lora_rank=8, **lora)


class HostCopies:
    """Records the manager's number of host copies after every load and every step."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.engine.core.executor.runner
        self.manager, self.counts, self.loads = runner.lora_manager, [], 0
        keep = getattr(self.manager, "_keep", None)
        load, mapping = self.manager._load, runner._lora_mapping

        def spy_keep(*args: Any, **kwargs: Any) -> None:
            keep(*args, **kwargs)
            self.counts.append(len(self.manager.adapters))

        def spy_load(*args: Any) -> Any:
            self.loads += 1
            return load(*args)

        def spy_mapping(inputs: Any) -> Any:
            self.counts.append(len(self.manager.adapters))
            return mapping(inputs)

        self.manager._load = spy_load
        if hasattr(self.manager, "_keep"):  # (absent before max_cpu_loras)
            self.manager._keep = spy_keep
        runner._lora_mapping = spy_mapping


def test_setting_defaults_to_max_loras_and_is_checked():
    assert LoRAConfig(enable_lora=True, max_loras=3).cpu_loras == 3
    assert LoRAConfig(enable_lora=True, max_loras=2, max_cpu_loras=5).cpu_loras == 5
    with pytest.raises(ValueError, match=r"max_cpu_loras=1 must be >= max_loras=2"):
        LoRAConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match=r"max_cpu_loras=4 needs enable_lora"):
        LoRAConfig(max_cpu_loras=4)


def test_cli_flag_sets_it():
    import argparse

    from kvflow.config.engine import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--model", "m", "--enable-lora", "--max-loras", "2",
                              "--max-cpu-loras", "6"])
    assert EngineConfig.from_cli_args(args).lora_config.cpu_loras == 6


def test_four_adapters_in_turn_keep_two_host_copies(tiny_llama, four, assert_no_leaks):
    """max_loras=1, max_cpu_loras=2, four adapters used in turn twice: never more than two
    copies, each use after the first round reads its folder again (the two kept are the two
    before it), and every request decodes peft's greedy tokens."""
    llm = _llm(tiny_llama, max_loras=1, max_cpu_loras=2)
    copies = HostCopies(llm)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    expected = {(i, j): peft_greedy(tiny_llama.path, four[i], ids)
                for i in range(4) for j, ids in enumerate(prompts)}
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(four)]
    for j, ids in enumerate(prompts):
        for i, lora in enumerate(loras):
            out = llm.generate([ids], PARAMS, lora_request=lora, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == expected[i, j], (i, j)
            kept = list(copies.manager.adapters)  # least recently used first
            assert kept[-1] == i + 1 and len(kept) == (1 if i == j == 0 else 2), kept
    assert max(copies.counts) == 2 and len(copies.counts) > 16
    assert copies.loads == 8  # 4 adapters x 2 rounds: each dropped before its next use
    assert set(copies.manager.evicted) == {1, 2}
    assert_no_leaks(llm)


def test_one_batch_of_four_adapters_keeps_two(tiny_llama, four, assert_no_leaks):
    """The four adapters' requests queued at once (max_loras=1: they run one after another):
    the queued ones' adapters are dropped for room and read again when they are scheduled;
    still at most two copies, and peft's tokens."""
    llm = _llm(tiny_llama, max_loras=1, max_cpu_loras=2)
    copies = HostCopies(llm)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(four)]
    outs = llm.generate([ids] * 4, PARAMS, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == \
        [peft_greedy(tiny_llama.path, path, ids) for path in four]
    assert max(copies.counts) == 2
    assert copies.loads > 4  # queued ones' adapters were read again
    assert_no_leaks(llm)


def test_running_requests_keep_their_adapters(tiny_llama, four, assert_no_leaks):
    """max_loras = max_cpu_loras = 2, two requests running with adapters 1 and 2: a third
    adapter added meanwhile is read (checked) and dropped itself, not a running one's; its
    request reads it again when scheduled, and all three decode peft's tokens."""
    llm = _llm(tiny_llama, max_loras=2)
    engine, manager = llm.engine, llm.engine.core.executor.runner.lora_manager
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(four[:3])]
    engine.add_request({"prompt_token_ids": ids}, PARAMS, "r1", lora_request=loras[0])
    engine.add_request({"prompt_token_ids": ids}, PARAMS, "r2", lora_request=loras[1])
    engine.step()
    running = dict(manager.adapters)
    engine.add_request({"prompt_token_ids": ids}, PARAMS, "r3", lora_request=loras[2])
    assert manager.adapters == running and set(manager.evicted) == {3}
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert outs == {f"r{i + 1}": peft_greedy(tiny_llama.path, four[i], ids) for i in range(3)}
    assert len(manager.adapters) == 2 and 3 in manager.adapters
    assert_no_leaks(llm)


def test_adapters_in_turn_at_the_default_limit_are_read_once_per_use(tiny_llama, four,
                                                                      assert_no_leaks):
    """max_loras = max_cpu_loras = 1 (the default), two adapters in turn: each use reads its
    folder once. The request before it has finished, though the runner hears so only at the
    next step; was: counted as holding its adapter, so the new one was read, dropped at once
    and read again at its first schedule (two reads a switch)."""
    llm = _llm(tiny_llama, max_loras=1)
    copies = HostCopies(llm)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(four[:2])]
    for lora in (*loras, *loras):
        out = llm.generate([ids], PARAMS, lora_request=lora, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama.path, lora.lora_path, ids)
    assert copies.loads == 4 and max(copies.counts) == 1
    assert_no_leaks(llm)


def test_folder_changed_after_eviction_is_read_as_it_is_then(tiny_llama, four, tmp_path,
                                                             assert_no_leaks):
    """As vLLM: an adapter dropped for room is read again from its folder, so files changed
    meanwhile take effect (another prompt: the prefix cache keys blocks by the adapter's id,
    name and folder, not its files, so the old weights' blocks would still be hit)."""
    folder = str(tmp_path / "changing")
    shutil.copytree(four[0], folder)
    llm = _llm(tiny_llama, max_loras=1, max_cpu_loras=1)
    tok = llm.get_tokenizer()
    first, second = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[1])
    changing, other = LoRARequest("changing", 1, folder), LoRARequest("other", 2, four[1])
    out = llm.generate([first], PARAMS, lora_request=changing, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == peft_greedy(tiny_llama.path, four[0], first)
    llm.generate([first], PARAMS, lora_request=other, use_tqdm=False)  # drops "changing"
    assert 1 in llm.engine.core.executor.runner.lora_manager.evicted
    for name in os.listdir(four[2]):
        shutil.copy(os.path.join(four[2], name), os.path.join(folder, name))
    out = llm.generate([second], PARAMS, lora_request=changing, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == peft_greedy(tiny_llama.path, four[2], second)
    assert out.outputs[0].token_ids != peft_greedy(tiny_llama.path, four[0], second)
    assert_no_leaks(llm)


def test_removed_adapter_is_not_read_again(tiny_llama, four, assert_no_leaks):
    """An adapter dropped for room and then unloaded is forgotten: the manager keeps no
    request of it, and its id loaded for another folder runs that folder."""
    llm = _llm(tiny_llama, max_loras=1, max_cpu_loras=1)
    core, ids = llm.engine.core, llm.get_tokenizer().encode(PROMPTS[0])
    llm.generate([ids], PARAMS, lora_request=LoRARequest("a", 1, four[0]), use_tqdm=False)
    llm.generate([ids], PARAMS, lora_request=LoRARequest("b", 2, four[1]), use_tqdm=False)
    manager = core.executor.runner.lora_manager
    assert set(manager.evicted) == {1}
    assert core.remove_lora(1) and manager.evicted == {}
    out = llm.generate([llm.get_tokenizer().encode(PROMPTS[1])], PARAMS,
                       lora_request=LoRARequest("c", 1, four[3]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == peft_greedy(
        tiny_llama.path, four[3], llm.get_tokenizer().encode(PROMPTS[1]))
    assert_no_leaks(llm)


def test_level_2_sleep_keeps_the_dropped_list(tiny_llama, four, assert_no_leaks):
    """An adapter dropped for room before a level-2 sleep is, after ``reload_weights``, read
    again and kept when asked for (not a copy for its request alone: the rebuilt manager
    would otherwise have forgotten that it was dropped), with peft's tokens."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
              block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8,
              enable_sleep_mode=True)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    first, second = LoRARequest("a", 1, four[0]), LoRARequest("b", 2, four[1])
    llm.generate([ids], PARAMS, lora_request=first, use_tqdm=False)
    llm.generate([ids], PARAMS, lora_request=second, use_tqdm=False)  # drops "a"
    llm.sleep(level=2)
    llm.wake_up()
    llm.collective_rpc("reload_weights")
    manager = llm.engine.core.executor.runner.lora_manager
    assert set(manager.adapters) == {2} and set(manager.evicted) == {1}
    out = llm.generate([ids], PARAMS, lora_request=first, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == peft_greedy(tiny_llama.path, four[0], ids)
    assert set(manager.adapters) == {1} and set(manager.evicted) == {2}
    assert_no_leaks(llm)
