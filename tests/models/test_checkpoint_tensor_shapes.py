"""A checkpoint tensor whose shape is not the one the config gives its layer is one
``ValueError`` naming the tensor and both shapes, never loaded scrambled or broadcast.

Before: the unfused linears (o_proj, down_proj, a tied or untied head's neighbours) compared
only the number of values and reshaped, so a transposed down_proj ``[128, 64]`` loaded into
the ``[64, 128]`` parameter as scrambled weights and generated other text; the fused q/k/v
and gate/up loaders checked the rows only, so a one-column q_proj was broadcast over all 64
input columns, and a 32-column one raised torch's "The size of tensor a (64) must match the
size of tensor b (32)" naming neither the tensor nor the config."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM


def _with_tensor(tiny, folder, name: str, edit) -> str:
    """A copy of the tiny model's folder with checkpoint tensor ``name`` replaced by
    ``edit(tensor)``."""
    path = shutil.copytree(tiny.path, str(folder))
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


# The tiny Llama: hidden 64, intermediate 128, 4 heads of 16, 2 KV heads.
@pytest.mark.parametrize("name, edit, message", [
    ("model.layers.0.mlp.down_proj.weight", lambda t: t.t(),
     "shape (128, 64) does not fit the (64, 128) the config gives this rank"),
    ("model.layers.1.self_attn.o_proj.weight", lambda t: t.reshape(-1),
     "shape (4096,) does not fit the (64, 64) the config gives this rank"),
    ("model.layers.0.self_attn.q_proj.weight", lambda t: t[:, :1],
     "shape (64, 1): the config gives it [64] past the rows (input features)"),
    ("model.layers.0.self_attn.q_proj.weight", lambda t: t[:, :32],
     "shape (64, 32): the config gives it [64] past the rows (input features)"),
    ("model.layers.0.self_attn.k_proj.weight", lambda t: t.reshape(32, 2, 32),
     "shape (32, 2, 32): the config gives it [64] past the rows (input features)"),
    ("model.layers.1.mlp.up_proj.weight", lambda t: t[:, :1],
     "shape (128, 1): the config gives it [64] past the rows (input features)"),
], ids=["transposed_down_proj", "flattened_o_proj", "q_proj_one_column",
        "q_proj_half_the_columns", "k_proj_3d", "up_proj_one_column"])
def test_tensor_of_another_shape_is_named(tiny_llama, tmp_path, name, edit, message):
    path = _with_tensor(tiny_llama, tmp_path / "model", name, edit)
    with pytest.raises(ValueError) as info:
        LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)
    assert str(info.value) == f"checkpoint tensor {name!r}: {message}"


def test_unfused_checkpoint_scale_of_shape_n_1_still_loads():
    """The relaxed case the check keeps: a per-channel scale stored ``[N, 1]`` (as
    compressed-tensors writes it) loads into a ``[N]`` parameter, values in order."""
    from kvflow.layers.linear import RowParallelLinear

    layer = RowParallelLinear(8, 4)
    scale = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    layer.weight_loader(scale, torch.arange(4.0).reshape(4, 1))
    assert scale.tolist() == [0.0, 1.0, 2.0, 3.0]
