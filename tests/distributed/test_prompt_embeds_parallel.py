"""Prompts given as embeddings over worker processes: the rows travel inside the step message
(``NewRequestData.prompt_embeds``, msgspec-encoded by ``executor/step_codec.py``) to every
rank, and tensor / pipeline parallel runs give the one-process engine's greedy tokens (itself
checked against HF ``generate(inputs_embeds=...)`` in tests/test_prompt_embeds.py).

The codec round trip and the tensor-parallel run (about 5 s) run by default; the pipeline run
with the slow distributed cases (scripts/test_distributed_slow.sh).
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.executor.step_codec import StepCodec
from kvflow.inputs.embeds import check_prompt_embeds
from kvflow.sampling_params import SamplingParams as Params
from kvflow.sched_output import NewRequestData, SchedulerOutput
from tests.distributed.conftest import SLOW, shutdown_and_check

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _embeds(seed: int, num_tokens: int) -> torch.Tensor:
    return 0.5 * torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_message_carries_the_rows(dtype):
    rows = _embeds(1, 5).to(dtype)
    packed = check_prompt_embeds(rows, 64, 32)
    new = NewRequestData("r", [0] * 5, Params(), None, ([1, 2],), 0, prompt_embeds=packed)
    codec = StepCodec()
    decoded, _ = codec.decode_step(codec.encode((SchedulerOutput(scheduled_new_reqs=[new]),
                                                 None)))
    got = decoded.scheduled_new_reqs[0].prompt_embeds
    assert got.identifier == packed.identifier
    assert torch.equal(got.tensor(), rows)


def _greedy(path: str, **kwargs) -> list[list[int]]:
    llm = LLM(model=path, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=8,
              block_size=4, max_model_len=64, enable_prompt_embeds=True, **kwargs)
    try:
        prompts = [{"prompt_embeds": _embeds(2, 13)}, [5, 17, 33, 2, 91],
                   {"prompt_embeds": _embeds(3, 6)}]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        shutdown_and_check(llm)


@pytest.mark.parametrize("kwargs", [
    {"tensor_parallel_size": 2},
    pytest.param({"pipeline_parallel_size": 2}, marks=SLOW),
], ids=["tp2", "pp2"])
def test_parallel_greedy_equals_one_process(tiny_model_factory, kwargs):
    path = tiny_model_factory("llama").path
    assert _greedy(path, **kwargs) == _greedy(path)
