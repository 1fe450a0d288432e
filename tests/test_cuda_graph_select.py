"""The CUDA-graph runner's Python side, without a GPU: which attention backends it captures.

A captured decode graph replays the kernels of one step with new inputs copied into static
buffers; the backend's ``prepare`` runs once, at capture time, and never again. So only a
backend whose ``prepare`` computes nothing from the step (the Triton one) may be captured: the
torch backend builds its causal mask from ``seq_lens`` in ``prepare``, and a replay would keep
the capture-time mask (every context of length 1).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.attention.torch_paged import TorchPagedAttentionBackend
from kvflow.worker.step_graphs import make_graph_runner


def _decode_meta(seq_lens: list[int], block_size: int = 4, width: int = 4) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.arange(n * width, dtype=torch.int32).view(n, width),
        max_query_len=1, max_seq_len=block_size * width, num_actual_tokens=n)


def _runner(backend) -> SimpleNamespace:
    """A ModelRunner as make_graph_runner reads it, on a platform that supports graphs."""
    return SimpleNamespace(
        config=SimpleNamespace(device_config=SimpleNamespace(enforce_eager=False),
                               scheduler_config=SimpleNamespace(max_num_seqs=4)),
        lora_manager=None, mm_runner=None, pooling=None, drafter=None,
        kv_cache_config=SimpleNamespace(kv_cache_groups=[object()]),
        parallel=SimpleNamespace(pp=SimpleNamespace(world_size=1)),
        platform=SimpleNamespace(supports_graphs=True),
        attn_ctx=SimpleNamespace(backend=backend), device=torch.device("cuda"),
        block_size=4)


def test_torch_backend_prepare_depends_on_the_step():
    """Why it cannot be captured: the mask prepare builds for contexts of 1 (capture time)
    hides keys a replayed step of context 3 must see."""
    backend = TorchPagedAttentionBackend()
    captured, replayed = _decode_meta([1, 1]), _decode_meta([3, 1])
    backend.prepare(captured, 4)
    backend.prepare(replayed, 4)
    assert captured.extra["mask"][0, 0, :3].tolist() == [True, False, False]
    assert replayed.extra["mask"][0, 0, :3].tolist() == [True, True, True]


def test_torch_backend_is_not_captured():
    assert make_graph_runner(_runner(TorchPagedAttentionBackend()), 16) is None


def test_a_backend_that_does_not_declare_itself_graph_safe_is_not_captured():
    """A backend (a plugin platform's, say) is captured only when it says it may be."""
    from kvflow.attention.backend import AttentionBackend

    class PluginBackend(AttentionBackend):
        name = "plugin"

        def forward(self, *args, **kwargs):
            raise AssertionError("not called")

    assert make_graph_runner(_runner(PluginBackend()), 16) is None


def test_graph_safe_backends_prepare_nothing():
    """Every built-in backend that says it may be captured keeps ``prepare`` a no-op, so the
    capture-time call leaves nothing a replay would reuse."""
    pytest.importorskip("triton")
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend

    backend = TritonPagedAttentionBackend(fuse_rotary=False)
    assert backend.supports_cuda_graphs
    meta = _decode_meta([3, 1])
    backend.prepare(meta, 4)
    assert meta.extra is None


def test_an_embedding_model_is_not_captured():
    """An encoder's attention reads query_start_loc on the host (a sync that breaks stream
    capture) and a pooling model never decodes: no CUDA graphs for embedding models."""
    pytest.importorskip("triton")
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend

    runner = _runner(TritonPagedAttentionBackend(fuse_rotary=False))
    runner.pooling = object()
    assert make_graph_runner(runner, 16) is None


def test_quantized_moe_experts_are_not_captured():
    """Quantized MoE experts (here GGUF's) count each expert's tokens on the host
    (``grouped_experts``), which stream capture cannot hold: such a model decodes eagerly
    (on this CPU-only machine, a capture attempt would raise instead of returning None)."""
    pytest.importorskip("triton")
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend
    from kvflow.layers.moe import FusedMoE
    from kvflow.quant.gguf_moe import GGUFFusedMoEMethod

    experts = FusedMoE(2, 1, hidden_size=8, intermediate_size=4, renormalize=True)
    experts.set_quant_method(GGUFFusedMoEMethod())
    runner = _runner(TritonPagedAttentionBackend(fuse_rotary=False))
    runner.model = torch.nn.Sequential(experts)
    assert make_graph_runner(runner, 16) is None


class _Replay:
    """A captured graph stand-in: records the runner's static inputs at each replay."""

    def __init__(self, runner, size: int, log: list) -> None:
        self.runner, self.size, self.log = runner, size, log

    def replay(self) -> None:
        r, s = self.runner, self.size
        self.log.append((s, r.slot_mapping[:s].tolist(), r.seq_lens[:s].tolist(),
                         r.block_table[:s, :2].tolist()))


def test_graph_runner_pads_to_the_next_size_and_refuses_larger_batches():
    """A batch of 3 replays the size-4 graph with row 3 as padding (slot -1, context 1, the
    null block), also right after a batch of 4 wrote real values there; a batch of 9 (more
    than the largest size, 8) or a prefill chunk runs eagerly."""
    from kvflow.worker.cuda_graphs import CudaGraphRunner

    runner = CudaGraphRunner(torch.nn.Identity(), None, max_num_seqs=8, max_blocks_per_seq=4,
                             max_model_len=16, block_size=4, hidden_size=2,
                             device=torch.device("cpu"), dtype=torch.float32)
    assert runner.sizes == [1, 2, 4, 8]
    log: list = []
    runner.graphs = {s: _Replay(runner, s, log) for s in runner.sizes}
    for seq_lens in ([5, 6, 7, 8], [9, 10, 11]):
        meta = _decode_meta(seq_lens)
        meta.slot_mapping = torch.tensor(seq_lens) - 1
        n = len(seq_lens)
        assert runner.can_run(meta)
        hidden = runner.run(torch.arange(n), torch.tensor(seq_lens) - 1, meta)
        assert hidden.shape == (n, 2)
    assert log[1] == (4, [8, 9, 10, -1], [9, 10, 11, 1],
                      [[0, 1], [4, 5], [8, 9], [0, 0]])
    assert not runner.can_run(_decode_meta([2] * 9))
    prefill = _decode_meta([3, 1])
    prefill.max_query_len = 2
    assert not runner.can_run(prefill)


def test_a_capture_out_of_memory_runs_eagerly(monkeypatch):
    """The graphs' memory pool is allocated after the KV cache took its budget; a capture that
    runs out of memory (gpu_memory_utilization near 1) leaves decode steps eager instead of
    failing the start-up."""
    pytest.importorskip("triton")
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend
    from kvflow.worker.cuda_graphs import CudaGraphRunner

    def oom(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(CudaGraphRunner, "capture", oom)
    runner = _runner(TritonPagedAttentionBackend(fuse_rotary=False))
    runner.model = torch.nn.Module()  # make_graph_runner walks its modules
    runner.model.config = SimpleNamespace(hidden_size=8)
    runner.device, runner.dtype = torch.device("cpu"), torch.float32
    assert make_graph_runner(runner, 16) is None


class _TappedModel(torch.nn.Module):
    """A stand-in target whose forward returns EAGLE-3's taps as LlamaModel does with
    ``aux_hidden_state_layers`` set: (hidden [T, 8], [T, 8] per tapped layer); row ``t`` is
    ``id_t`` in hidden and ``id_t + j + 1`` in tap ``j``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = SimpleNamespace(aux_hidden_state_layers=(1, 0))

    def forward(self, input_ids, positions):
        hidden = input_ids.float()[:, None].expand(-1, 8).clone()
        return hidden, [hidden + 1, hidden + 2]


def test_an_eagle3_target_is_captured_with_static_tap_outputs(monkeypatch):
    """EAGLE-3's taps come back from the target's forward (no hooks), so an engine with such a
    head is captured; the captured function copies the taps into static outputs of their own
    and ``run`` hands back their rows. Checked without a GPU: the captured function runs in
    place of a replay (what CUDA graph capture itself does is left to tests/gpu)."""
    pytest.importorskip("triton")
    from kvflow.attention.layer import AttentionContext
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend
    from kvflow.worker.cuda_graphs import CudaGraphRunner

    def capture(self):
        raise RuntimeError("captured")

    monkeypatch.setattr(CudaGraphRunner, "capture", capture)
    runner = _runner(TritonPagedAttentionBackend(fuse_rotary=False))
    runner.model = _TappedModel()
    runner.model.config = SimpleNamespace(hidden_size=8)
    runner.device, runner.dtype = torch.device("cpu"), torch.float32
    runner.drafter = SimpleNamespace(taps=object())
    with pytest.raises(RuntimeError, match="captured"):
        make_graph_runner(runner, 16)
    graphs = CudaGraphRunner(runner.model, AttentionContext(runner.attn_ctx.backend), 4, 4, 16,
                             4, 8, torch.device("cpu"), torch.float32)
    for size in graphs.sizes:
        graphs.metas[size] = graphs._meta(size)
        graphs.graphs[size] = SimpleNamespace(replay=lambda size=size: graphs._forward(size))
    ids = torch.tensor([5, 7, 9])
    hidden, taps = graphs.run(ids, torch.zeros(3, dtype=torch.int64), _decode_meta([3, 2, 1]))
    assert hidden[:, 0].tolist() == [5, 7, 9]
    assert [t[:, 0].tolist() for t in taps] == [[6, 8, 10], [7, 9, 11]]
    assert all(t.data_ptr() == s.data_ptr() for t, s in zip(taps, graphs.aux, strict=True))
