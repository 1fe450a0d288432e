"""Engine-level CUDA checks (skipped without a GPU): greedy tokens on CUDA (Triton attention,
fused kernels, with and without CUDA graphs) equal the CPU torch reference backend, fp32, on a
tiny random Llama, with chunked prefill forced and prefix caching on."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 17, 40, 33))]
# Two prompts share a 32-token prefix so prefix caching hits.
PROMPTS.append(PROMPTS[2][:32] + [11, 12, 13])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-gpu")
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _greedy(model_path: str, **kwargs) -> list[list[int]]:
    from kvflow import LLM, SamplingParams

    llm = LLM(model=model_path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=256,
              max_num_batched_tokens=16, max_num_seqs=8, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    core = llm.engine.core
    core.kv_cache_manager.pool.check_invariants()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cpu_reference(tiny_llama):
    return _greedy(tiny_llama, device="cpu", attention_backend="torch")


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_greedy_matches_cpu_reference(tiny_llama, cpu_reference, enforce_eager):
    got = _greedy(tiny_llama, device="cuda", enforce_eager=enforce_eager)
    assert got == cpu_reference


def test_cuda_graphs_are_used_for_decode(tiny_llama):
    from kvflow import LLM, SamplingParams

    llm = LLM(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              device="cuda", max_num_seqs=8)
    runner = llm.engine.core.executor.runner
    assert runner.graph_runner is not None and set(runner.graph_runner.graphs) == {1, 2, 4, 8}
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_async_scheduling_matches_cpu_reference(tiny_llama, cpu_reference, enforce_eager):
    """--async-scheduling on CUDA: step N+1 reads step N's tokens on the device (graph replay
    included) and gives the CPU reference's greedy tokens."""
    got = _greedy(tiny_llama, device="cuda", enforce_eager=enforce_eager,
                  async_scheduling=True)
    assert got == cpu_reference


def test_cuda_async_scheduling_equals_lock_step_when_sampling(tiny_llama):
    """Seeded sampling, a stop id met mid-way and max_tokens: the same tokens and finish
    reasons on CUDA with and without async scheduling."""
    from kvflow import LLM, SamplingParams

    def run(async_scheduling: bool) -> list:
        llm = LLM(model=tiny_llama, dtype="float32", skip_tokenizer_init=True,
                  num_kv_blocks=256, max_num_seqs=8, device="cuda",
                  async_scheduling=async_scheduling)
        greedy = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True), use_tqdm=False)
        stop_id = greedy[0].outputs[0].token_ids[6]
        params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                  SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=2, max_tokens=7, top_p=0.9,
                                 ignore_eos=True, presence_penalty=0.5)]
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    expected = run(False)
    assert expected[0][1] == "stop"
    assert run(True) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_deterministic_batch_invariant(tiny_llama, dtype):
    """--deterministic on CUDA (never run in this repository's sessions: no GPU; the kernels
    are checked in Triton's interpreter in tests/kernels/test_batch_invariant_triton.py): the
    watched prompt's tokens and logprobs alone equal those inside batches of 2-64 requests."""
    from kvflow import LLM, SamplingParams

    target = PROMPTS[2]
    others = [[(13 * i + 5 * j) % 500 + 1 for j in range(3 + (i * 7) % 60)] for i in range(63)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    llm = LLM(model=tiny_llama, dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=512,
              device="cuda", deterministic=True, max_num_batched_tokens=64,
              enable_prefix_caching=False)

    def run(batch):
        prompts = [{"prompt_token_ids": p} for p in batch]
        prompts.insert(len(batch) // 2, {"prompt_token_ids": target})
        out = llm.generate(prompts, params, use_tqdm=False)[len(batch) // 2].outputs[0]
        return out.token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                               for d in out.logprobs]

    alone = run([])
    for size in (1, 7, 63):
        assert run(others[:size]) == alone, size


def test_cuda_torch_backend_runs_eagerly_and_matches(tiny_llama, cpu_reference):
    """--attention-backend torch on CUDA: no CUDA graphs (its prepare builds the step's mask
    on the host side of the graph; a replay would keep the capture-time one) and the CPU
    reference's tokens. Written without a GPU run (session 19)."""
    from kvflow import LLM

    assert _greedy(tiny_llama, device="cuda", attention_backend="torch") == cpu_reference
    llm = LLM(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              device="cuda", attention_backend="torch", max_num_seqs=8)
    assert llm.engine.core.executor.runner.graph_runner is None


def test_cuda_bert_embeddings_start_and_match_sentence_transformers(tiny_tokenizer,
                                                                   tmp_path_factory):
    """An encoder on CUDA starts without --enforce-eager (graph capture of its host-synced
    attention is skipped) and embeds as sentence-transformers does on CPU. Written without a
    GPU run (session 19)."""
    from kvflow import LLM
    from tests.models.embedding_models import build_bert, st_embed

    folder = str(tmp_path_factory.mktemp("bert_gpu") / "st")
    st = build_bert(tiny_tokenizer, folder, "mean")
    sentences = ["the quick brown fox", "a", "keys and values through blocks of tokens"]
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=64)
    assert llm.engine.core.executor.runner.graph_runner is None
    outs = llm.embed(sentences, use_tqdm=False)
    for out, ref in zip(outs, st_embed(st, sentences)):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-4,
                                   rtol=1e-3)
