"""Before any worker starts: whether a GGUF kept quantized (``--quantization gguf``) splits over
``--tensor-parallel-size`` ranks without cutting a GGML block.

Row-parallel weights (``attn_output``, ``ffn_down``, the experts' ``ffn_down_exps`` and the
shared expert's ``ffn_down_shexp``) are split by input columns (:mod:`kvflow.quant.gguf_tp`),
which works when each rank's width is whole blocks of the tensor's type (32 elements for
Q4_0/Q4_1/Q5_0/Q8_0, 256 for Q4_K/Q5_K/Q6_K). The workers would refuse such a tensor when they
load it; this reads the file's header (tensor types and shapes) once, so the refusal comes at
start-up, naming the tensor, before ranks start. Tensors the loader dequantizes (float types,
types without a kept kernel, and the experts under ``KVFLOW_GGUF_MOE=dequantized``) and
experts placed whole by expert parallelism split anywhere.
"""

from __future__ import annotations

import re

from kvflow.config import gguf_moe_experts_choice
from kvflow.kernels.gguf_dequant import BLOCK_SHAPES, TYPE_NAMES
from kvflow.models.gguf_reader import read_gguf_metadata

# blk.N.<row-parallel tensor>[.E].weight (.E: early Mixtral GGUFs' one tensor per expert)
_ROW_PARALLEL_RE = re.compile(
    r"^blk\.\d+\.(attn_output|ffn_down|ffn_down_shexp|ffn_down_exps)(\.\d+)?\.weight$")


def check_tp_block_splits(path: str, tp_size: int, expert_parallel: bool = False) -> None:
    """Refuse a GGUF whose kept row-parallel blocks ``tp_size`` ranks would cut.

    Args:
        path: the ``.gguf`` file.
        tp_size: ``tensor_parallel_size`` (nothing to check at 1).
        expert_parallel: experts are placed whole (``enable_expert_parallel``), not split.

    Raises:
        ValueError: naming the first such tensor, its type, the block size and the split.
    """
    if tp_size == 1:
        return
    experts_kept = gguf_moe_experts_choice() == "quantized"
    for info in read_gguf_metadata(path).tensors:
        match = _ROW_PARALLEL_RE.match(info.name)
        if match is None or info.ggml_type not in BLOCK_SHAPES:
            continue
        expert = match.group(1) == "ffn_down_exps" or match.group(2) is not None
        if expert and (expert_parallel or not experts_kept):
            continue
        block, cols = BLOCK_SHAPES[info.ggml_type][0], info.shape[-1]
        if cols % (tp_size * block):
            raise ValueError(
                f"{path!r}: {info.name} ({TYPE_NAMES[info.ggml_type]}, blocks of {block} "
                f"elements) cannot be split by columns over tensor_parallel_size {tp_size}: "
                f"{cols} / {tp_size} = {cols / tp_size:g} is not a multiple of {block}; use "
                "fewer ranks or --quantization none (dequantized at load)")
