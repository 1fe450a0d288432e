"""Integer arguments of the Triton kernels that change from step to step are not specialized.

Triton compiles a variant of a kernel per value class of each specialized integer argument
(equal to 1, a multiple of 16, other), the first time a launch meets it. An argument that
follows the batch (token count, the block table's width) therefore compiles new variants in
the middle of a run, each a stall of a second or more on a GPU (the engine's warm-up and
graph capture meet only some classes). The interpreter never compiles, so no CPU run shows
it; these lists do. Each entry: the kernel, and its arguments that change between steps
(the rest are fixed per model: head counts, strides of the weights and caches)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kvflow.kernels import batch_invariant_gemm, moe, paged_attention_kernels, rotary_kv_store


def _unspecialized(kernel) -> set[str]:
    """The names ``kernel`` (a ``@triton.jit`` function, or its interpreter stand-in under
    ``TRITON_INTERPRET=1``) does not specialize on."""
    raw = kernel.kwargs.get("do_not_specialize", ()) if hasattr(kernel, "kwargs") \
        else kernel.do_not_specialize
    return {kernel.arg_names[a] if isinstance(a, int) else a for a in raw or ()}


PER_STEP_ARGUMENTS = [
    (paged_attention_kernels.paged_attention_kernel,
     {"num_seqs", "num_tokens", "sliding_window", "softcap_log2", "stride_bt"}),
    (paged_attention_kernels.merge_splits_kernel, {"num_tokens"}),
    (moe._grouped_gemm_kernel, {"M"}),
    (batch_invariant_gemm._gemm_kernel, {"M"}),
    (rotary_kv_store._rotary_kv_store_kernel, {"num_slots"}),
]


@pytest.mark.parametrize("kernel,per_step", PER_STEP_ARGUMENTS,
                         ids=[k.__name__ for k, _ in PER_STEP_ARGUMENTS])
def test_per_step_arguments_are_not_specialized(kernel, per_step):
    assert per_step <= set(kernel.arg_names)  # the names are the kernel's own
    assert per_step <= _unspecialized(kernel)
