"""A config.json size (layers, vocabulary, MLP and expert widths, expert count) larger than its
checkpoint's tensors is one ``ValueError`` naming the file and the field, raised from the
safetensors headers before the model is built: every size is allocated at build time, so a
corrupt 2**40 was torch's "can't allocate memory: you tried to allocate 281474976710656 bytes",
and a ``num_hidden_layers`` of 2**40 built layer after layer until the process was killed for
memory (1.8 GB in 28 s under a 6 GB address-space limit, then a RuntimeError)."""

from __future__ import annotations

import os
import re

import pytest

from kvflow import LLM
from kvflow.models import loader
from tests.folder_edits import copy_with_json


@pytest.fixture
def no_model_build(monkeypatch):
    """Building the model class fails the test (instead of allocating the sizes given)."""
    real = loader.get_model_class

    def model_class(architectures):
        cls = real(architectures)

        class NotBuilt(cls):
            def __init__(self, *args, **kwargs):
                raise AssertionError(f"{cls.__name__} was built from the config")

        return NotBuilt

    monkeypatch.setattr(loader, "get_model_class", model_class)


# The tiny Llama: vocab 320, hidden 64, intermediate 128, 2 layers.
@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 2**40}, ("num_hidden_layers=1099511627776 is more than the "
     "checkpoint holds: its tensors are for layers 0..1 (2 layers)")),
    ({"num_hidden_layers": 3}, ("num_hidden_layers=3 is more than the checkpoint holds: its "
     "tensors are for layers 0..1 (2 layers)")),
    ({"vocab_size": 2**40}, ("vocab_size=1099511627776 is larger than the checkpoint's "
     "embedding 'model.embed_tokens.weight' of shape [320, 64] ([vocab_size, hidden_size])")),
    ({"hidden_size": 2**40}, ("hidden_size=1099511627776 is larger than the checkpoint's "
     "embedding 'model.embed_tokens.weight' of shape [320, 64] ([vocab_size, hidden_size])")),
    ({"intermediate_size": 2**40}, ("intermediate_size=1099511627776 is larger than the "
     "checkpoint's MLP: 'model.layers.0.mlp.down_proj.weight' has 128 columns "
     "([hidden_size, intermediate_size])")),
    # the head size also sizes the rotary table: "tried to allocate 4398046511104 bytes"
    ({"head_dim": 2**40}, ("head_dim=1099511627776 x num_key_value_heads=2 is more rows than "
     "the checkpoint's 'model.layers.0.self_attn.k_proj.weight' has (32)")),
], ids=["layers_2e40", "layers_3", "vocab_2e40", "hidden_2e40", "intermediate_2e40",
        "head_dim_2e40"])
def test_size_larger_than_the_checkpoint_is_refused_before_the_build(
        tiny_llama, tmp_path, no_model_build, changes, message):
    config_path = copy_with_json(tiny_llama.path, tmp_path / "model", **changes)
    with pytest.raises(ValueError, match=re.escape(f"model config {config_path!r}: {message}")):
        LLM(model=os.path.dirname(config_path), dtype="float32", device="cpu",
            num_kv_blocks=16, block_size=4)


def test_smaller_size_is_left_to_the_weight_loading(tiny_llama, tmp_path):
    """A size smaller than the checkpoint's allocates less; the loader names the tensor that
    does not fit, as before."""
    config_path = copy_with_json(tiny_llama.path, tmp_path / "model", vocab_size=300)
    with pytest.raises(ValueError, match=re.escape(
            "checkpoint tensor 'lm_head.weight': shape (320, 64): the config gives "
            "[vocab_size, hidden_size] = [300, 64]")):
        LLM(model=os.path.dirname(config_path), dtype="float32", device="cpu",
            num_kv_blocks=16, block_size=4)


# The tiny Qwen2-MoE: 4 experts of width 32, a shared expert of 48, layer 1 a dense MLP of 128;
# the tiny Mixtral: 4 experts of width 64 (its intermediate_size).
@pytest.mark.parametrize("arch, changes, message", [
    ("qwen2_moe", {"num_experts": 2**40}, ("num_experts=1099511627776 is more than the "
     "checkpoint holds: its expert tensors are for experts 0..3")),
    ("qwen2_moe", {"moe_intermediate_size": 2**40}, ("moe_intermediate_size=1099511627776 is "
     "larger than the checkpoint's experts: 'model.layers.0.mlp.experts.0.down_proj.weight' "
     "has 32 columns ([hidden_size, moe_intermediate_size])")),
    ("qwen2_moe", {"shared_expert_intermediate_size": 2**40}, (
     "shared_expert_intermediate_size=1099511627776 is larger than the checkpoint's shared "
     "expert: 'model.layers.0.mlp.shared_expert.down_proj.weight' has 48 columns "
     "([hidden_size, shared_expert_intermediate_size])")),
    ("mixtral", {"num_local_experts": 5}, ("num_local_experts=5 is more than the checkpoint "
     "holds: its expert tensors are for experts 0..3")),
    ("mixtral", {"intermediate_size": 2**40}, ("intermediate_size=1099511627776 is larger "
     "than the checkpoint's experts: 'model.layers.0.block_sparse_moe.experts.0.w2.weight' "
     "has 64 columns ([hidden_size, intermediate_size])")),
], ids=["qwen2_moe_experts_2e40", "qwen2_moe_width_2e40", "qwen2_moe_shared_2e40",
        "mixtral_experts_5", "mixtral_width_2e40"])
def test_moe_size_larger_than_the_checkpoint_is_refused_before_the_build(
        tiny_model_factory, tmp_path, no_model_build, arch, changes, message):
    config_path = copy_with_json(tiny_model_factory(arch).path, tmp_path / "model", **changes)
    with pytest.raises(ValueError, match=re.escape(f"model config {config_path!r}: {message}")):
        LLM(model=os.path.dirname(config_path), dtype="float32", device="cpu",
            num_kv_blocks=16, block_size=4)
