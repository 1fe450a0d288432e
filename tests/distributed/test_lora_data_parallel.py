"""Multi-LoRA with ``data_parallel_size=2`` (two engine-core processes) against transformers +
peft: prompts of two random PEFT adapters and of the base model queued at once are spread over
both replicas (each replica runs both adapters), and each prompt's greedy tokens are peft's
running its adapter alone (fp32, one process per replica: exact, as in
tests/lora/test_lora_engine.py). Then an adapter is removed on every replica and its id
reused for another folder (a replica that kept the old weights or cached blocks would decode
the old adapter), and a refused adapter leaves the replicas serving.
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import MAX_TOKENS, make_mixed_adapters, peft_greedy

PROMPTS = ["the quick brown fox jumps over", "prefix caching reuses them, chunked prefill",
           "a lazy dog while kvflow pages keys and values through blocks",
           "one two three four five six seven"]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dp_adapters")
    return make_mixed_adapters(tiny_llama.path, root)


def test_adapters_on_both_replicas_match_peft(tiny_llama, adapters):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8,
              data_parallel_size=2)
    client = llm.engine.core
    try:
        sent: list[int] = []  # the replica of each prompt, as the balancer chose it
        add_requests = client.add_requests
        client.add_requests = lambda requests: sent.append(add_requests(requests)) or sent[-1]
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        lora_all, lora_qv = LoRARequest("all", 1, adapters["all"]), \
            LoRARequest("qv", 2, adapters["qv"])
        loras = [lora_all, lora_qv, lora_qv, lora_all]
        outs = llm.generate(ids, GREEDY, lora_request=loras, use_tqdm=False)
        # queued at once, least depth first: replicas 0, 1, 0, 1, so each runs both adapters
        assert sent == [0, 1, 0, 1]
        expected = [peft_greedy(tiny_llama.path, lr.lora_path, p) for p, lr in zip(ids, loras)]
        assert [o.outputs[0].token_ids for o in outs] == expected
        base = llm.generate([ids[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert base == peft_greedy(tiny_llama.path, None, ids[0]) != expected[0]

        # id 1 removed on every replica, then reused (same name) for the other folder: the
        # same prompts, on both replicas, must give the new folder's tokens
        assert client.remove_lora(1) and not client.remove_lora(1)
        sent.clear()
        reused = LoRARequest("all", 1, adapters["qv"])
        outs = llm.generate(ids[:2], GREEDY, lora_request=reused, use_tqdm=False)
        assert sorted(sent) == [0, 1]
        assert [o.outputs[0].token_ids for o in outs] == [
            peft_greedy(tiny_llama.path, adapters["qv"], p) for p in ids[:2]]

        # a refused adapter (rank 16 > max_lora_rank 8) is loaded on no replica
        with pytest.raises(ValueError, match="max_lora_rank"):
            llm.generate([ids[0]], GREEDY, lora_request=LoRARequest("wide", 9,
                                                                    adapters["too_wide"]),
                         use_tqdm=False)
        assert sorted(client.loras) == [1, 2]
        # and the replicas keep serving, the id free for an adapter they accept
        out = llm.generate([ids[3]], GREEDY, lora_request=LoRARequest("wide", 9,
                                                                      adapters["all"]),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama.path, adapters["all"], ids[3])
    finally:
        llm.shutdown()
