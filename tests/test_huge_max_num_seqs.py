"""A ``max_num_seqs`` far beyond what the machine holds is refused with one ValueError naming
it, and a large one that fits still runs. ``--max-num-seqs 1000000000`` used to end in a
traceback: first oneDNN's, while packing the weights (the engine passes max_num_seqs to
``_reorder_linear_weight`` as its batch hint, and a hint in the tens of millions overflowed
its descriptors: "could not create a primitive descriptor for the inner product forward
propagation primitive"), then numpy's ``_ArrayMemoryError`` for the runner's rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, SamplingParams
from kvflow.kernels.gemm import OneDnnPackedWeight

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                            reason="torch built without oneDNN")


@onednn
@pytest.mark.parametrize("batch_hint", [1, 64, 10**9, 2**31])
def test_any_batch_hint_packs_and_multiplies_exactly(batch_hint):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(128, 576, generator=gen)
    x = torch.randn(3, 576, generator=gen)
    packed = OneDnnPackedWeight(w, batch_hint)
    torch.testing.assert_close(packed(x, None), F.linear(x, w), rtol=1e-5, atol=1e-4)


@onednn
def test_engine_refuses_rows_it_cannot_hold_and_runs_many_it_can(tiny_llama):
    kwargs = {"model": tiny_llama.path, "dtype": "float32", "device": "cpu",
              "num_kv_blocks": 16, "cpu_gemm": "onednn"}
    with pytest.raises(ValueError, match=r"^max_num_seqs=1000000000000: the runner's rows "
                                         r"for that many requests do not fit"):
        LLM(max_num_seqs=10**12, **kwargs)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = [LLM(max_num_seqs=n, **kwargs).generate([[5, 6, 7]], greedy)[0].outputs[0]
               for n in (10**6, 256)]  # 10**6 rows: zero pages until used
    assert len(outputs[0].token_ids) == 4
    assert outputs[0].token_ids == outputs[1].token_ids  # the default engine's tokens
