"""Custom logits processors under tensor parallelism: each of the 2 worker processes builds
its own instances (from class paths it imports) and tells them its own batch's changes, and
the greedy tokens still equal a plain torch loop over transformers' logits with the same
ban / forced tokens (tests/test_logits_processors.py's cases: rows moved by requests of
different lengths, chunked prompts). About 15 s on 2 busy cores (2 worker processes): a
tensor-parallel variant of tests/test_logits_processors.py's default-run cases, so it runs in
scripts/test_distributed_slow.sh.
"""

from __future__ import annotations

from kvflow import LLM, SamplingParams
from tests.distributed.conftest import shutdown_and_check, slow
from tests.test_logits_processors import HERE, _cases, _expected


@slow
def test_tensor_parallel_ranks_apply_the_processors(tiny_llama, tiny_tokenizer):
    cases = _cases(tiny_llama, tiny_tokenizer)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, max_num_seqs=3, max_num_batched_tokens=6,
              tensor_parallel_size=2,
              logits_processors=[f"{HERE}:BanToken", f"{HERE}:ForceEvery"])
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                 extra_args=args or None) for _, n, args in cases]
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in cases], params,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == _expected(tiny_llama, cases)
    finally:
        shutdown_and_check(llm)
