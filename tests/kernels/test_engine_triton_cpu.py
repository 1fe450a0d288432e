"""Engine-level checks of the GPU code paths on CPU, with Triton in the interpreter:

* the Triton attention backend inside the whole engine gives the torch backend's greedy tokens
  (mixed prefill chunks + decodes, prefix-cache hits);
* the CUDA-graph runner's static-buffer bookkeeping (padding rows with slot -1, seq_len 1 and
  the null block) gives the same tokens, with graph replay stood in for by an eager call of the
  captured function (torch.cuda.graph itself needs a GPU; tests/gpu covers the real thing).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

PROMPTS = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 9, 21, 34))]
PROMPTS.append(PROMPTS[3][:32] + [7, 8])  # shares two full blocks with prompt 3



def _greedy(llm) -> list[list[int]]:
    from kvflow import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    kv = llm.engine.core.kv_cache_manager
    kv.pool.check_invariants()
    assert kv.num_free_blocks == llm.engine.core.num_blocks - 1
    return [o.outputs[0].token_ids for o in outs]


def _llm(path: str, backend: str, kv_cache_dtype: str = "auto"):
    from kvflow import LLM

    return LLM(model=path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
               max_num_batched_tokens=24, max_num_seqs=8, attention_backend=backend,
               device="cpu", kv_cache_dtype=kv_cache_dtype)


@pytest.fixture(scope="module")
def reference(tiny_llama_path, unfused_greedy):
    return unfused_greedy(tiny_llama_path, "torch")


def test_triton_backend_matches_torch_backend(tiny_llama_path, reference, unfused_greedy):
    """(The unfused runs are shared with tests/kernels/test_fused_kernels_engine.py.)"""
    assert unfused_greedy(tiny_llama_path, "triton") == reference


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_triton_backend_reads_a_quantized_cache_as_torch_does(tiny_llama_path, kv_cache_dtype,
                                                              unfused_greedy):
    """Same rotated (INT8) or plain (FP8) rows in the cache, read by the Triton kernel and by
    the torch backend's dequantize-and-SDPA: the same greedy tokens."""
    torch_tokens = unfused_greedy(tiny_llama_path, "torch", kv_cache_dtype)
    assert unfused_greedy(tiny_llama_path, "triton", kv_cache_dtype) == torch_tokens


class _EagerReplay:
    """Stands in for a captured CUDAGraph: replay runs the captured function eagerly."""

    def __init__(self, fn):
        self.replay = fn


def test_graph_runner_padding_matches_eager(tiny_llama_path, reference, monkeypatch):
    from kvflow.worker.cuda_graphs import CudaGraphRunner

    def fake_capture(self):
        for size in self.sizes:
            self.metas[size] = self._meta(size)
            self.graphs[size] = _EagerReplay(lambda s=size: self._forward(s))

    monkeypatch.setattr(CudaGraphRunner, "capture", fake_capture)
    llm = _llm(tiny_llama_path, "triton")
    runner = llm.engine.core.executor.runner
    monkeypatch.setattr(runner.platform, "supports_graphs", True)
    runner.capture_graphs(llm.engine.core.max_model_len)
    replays = []
    run = CudaGraphRunner.run
    monkeypatch.setattr(CudaGraphRunner, "run",
                        lambda self, *a: replays.append(a[2].num_reqs) or run(self, *a))
    assert _greedy(llm) == reference
    assert replays and max(replays) > 1  # decode batches of several requests went through it
    assert runner.graph_runner.sizes == [1, 2, 4, 8]
