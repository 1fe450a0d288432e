"""``load_format="dummy"``: the weights' bytes from config.json's sizes, checked against the
memory available before anything is built (a config with num_hidden_layers 10**7 used to
build layer after layer until the process was killed for memory). Oracles: transformers'
own models of the same configs, built on the meta device (their parameter counts), and
hand-computed cgroup numbers."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvflow import LLM
from kvflow.distributed.comm import CommGroup
from kvflow.distributed.parallel_state import ParallelState
from kvflow.models import dummy_weight_bytes
from kvflow.models.dummy_weight_bytes import min_weight_bytes
from kvflow.platforms import memory_limits

SMALL = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
         "num_hidden_layers": 3, "vocab_size": 1000}
CONFIGS = {  # class -> (config fields, encoder-only)
    "LlamaConfig": ({**SMALL, "num_key_value_heads": 2, "tie_word_embeddings": False}, False),
    "Qwen2Config": ({**SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True}, False),
    "Gemma2Config": ({**SMALL, "num_key_value_heads": 1, "head_dim": 32}, False),
    "MixtralConfig": ({**SMALL, "num_key_value_heads": 2, "num_local_experts": 4}, False),
    "DeepseekV3Config": ({**SMALL, "num_key_value_heads": 4, "n_routed_experts": 4,
                          "moe_intermediate_size": 32, "kv_lora_rank": 16,
                          "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                          "v_head_dim": 8, "first_k_dense_replace": 1, "n_group": 1,
                          "topk_group": 1, "num_experts_per_tok": 2}, False),
    "BertConfig": ({**SMALL}, True),
}


def _hf_bytes(cls_name: str, fields: dict, dtype: torch.dtype) -> tuple[object, int]:
    config = getattr(transformers, cls_name)(**fields)
    model_cls = transformers.AutoModel if cls_name == "BertConfig" \
        else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = model_cls.from_config(config)
    return config, sum(p.numel() for p in model.parameters()) * dtype.itemsize


@pytest.mark.parametrize("cls_name", sorted(CONFIGS))
def test_the_bound_is_below_transformers_parameter_bytes(cls_name):
    """Never above the real size (a model that fits is never refused); for the dense
    decoders, within the norms and biases of it."""
    fields, encoder = CONFIGS[cls_name]
    config, real = _hf_bytes(cls_name, fields, torch.bfloat16)
    bound = min_weight_bytes(config, torch.bfloat16, encoder=encoder, lm_head=not encoder)
    assert 0 < bound <= real
    if cls_name in ("LlamaConfig", "Qwen2Config", "Gemma2Config"):
        assert bound >= 0.97 * real


def test_llama_bound_by_hand():
    """Tiny Llama, untied, fp32: embedding and LM head 1000 x 64 each; per layer q and o
    64 x 64, k and v 64 x 32, gate, up and down 64 x 160."""
    config = transformers.LlamaConfig(**CONFIGS["LlamaConfig"][0])
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160
    want = (2 * 1000 * 64 + 3 * per_layer) * 4
    assert min_weight_bytes(config, torch.float32) == want
    assert min_weight_bytes(config, torch.float32, lm_head=False) == want - 1000 * 64 * 4
    # tensor parallel 2, pipeline parallel 3 (one layer per stage, no embedding counted)
    two = CommGroup([0, 1], 0, device_group=object())
    three = CommGroup([0, 1, 2], 0, device_group=object())
    one = CommGroup.single()
    parallel = ParallelState(one, two, three, one, one)
    assert min_weight_bytes(config, torch.float32, parallel=parallel) == per_layer * 4 // 2


def test_dummy_weights_that_do_not_fit_are_refused_before_building(tiny_llama):
    """10**7 layers of the tiny Llama: terabytes of weights, refused at once, naming the
    sizes, the bytes and the memory available (before: built until killed for memory)."""
    with pytest.raises(ValueError, match=r"load_format='dummy': the model config "
                       r"\(num_hidden_layers=10000000, hidden_size=\d+.*\) needs at least "
                       r"[\d.]+ GiB of torch.float32 weights on this rank, more than the "
                       r"[\d.]+ GiB available \("):
        LLM(model=tiny_llama.path, load_format="dummy", dtype="float32", num_kv_blocks=16,
            hf_overrides={"num_hidden_layers": 10**7})


def test_dummy_weights_check_the_memory_available(tiny_llama, monkeypatch):
    """With 1 KiB available the tiny Llama's dummy weights are refused; with the real memory
    they load."""
    real = dummy_weight_bytes.device_memory_available
    monkeypatch.setattr(dummy_weight_bytes, "device_memory_available",
                        lambda device: (2**10, "a test's limit"))
    with pytest.raises(ValueError, match=r"more than the 0.00 GiB available \(a test's limit\)"):
        LLM(model=tiny_llama.path, load_format="dummy", dtype="float32", num_kv_blocks=16)
    monkeypatch.setattr(dummy_weight_bytes, "device_memory_available", real)
    llm = LLM(model=tiny_llama.path, load_format="dummy", dtype="float32", num_kv_blocks=16)
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids


def _write(folder, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_cgroup_v2_memory_headroom_is_the_tightest_of_the_process_and_its_ancestors(tmp_path):
    # the pod: 8 GiB limit, 5 GiB used of which 1 GiB inactive file cache -> 4 GiB left;
    # the app: 6 GiB limit, 3 GiB used -> 3 GiB left; the root: no limit ("max")
    _write(tmp_path, {"memory.max": "max\n", "memory.current": "123\n"})
    _write(tmp_path / "pod", {"memory.max": f"{8 * 2**30}\n",
                              "memory.current": f"{5 * 2**30}\n",
                              "memory.stat": f"anon 1\ninactive_file {2**30}\n"})
    _write(tmp_path / "pod" / "app", {"memory.max": f"{6 * 2**30}\n",
                                      "memory.current": f"{3 * 2**30}\n"})
    assert memory_limits.cgroup_memory_headroom(tmp_path, "0::/pod/app\n") == 3 * 2**30
    assert memory_limits.cgroup_memory_headroom(tmp_path, "0::/pod\n") == 4 * 2**30
    assert memory_limits.cgroup_memory_headroom(tmp_path, "0::/\n") is None


def test_cgroup_v1_memory_headroom(tmp_path):
    # v1 "no limit" is 2**63 - 1 rounded down to a page
    _write(tmp_path / "memory", {"memory.limit_in_bytes": "9223372036854771712\n",
                                 "memory.usage_in_bytes": "5\n"})
    _write(tmp_path / "memory" / "job", {"memory.limit_in_bytes": f"{2**30}\n",
                                         "memory.usage_in_bytes": f"{2**29}\n",
                                         "memory.stat": "inactive_file 7\n"
                                                        f"total_inactive_file {2**20}\n"})
    proc = "4:memory:/job\n3:cpu,cpuacct:/\n0::/\n"
    assert memory_limits.cgroup_memory_headroom(tmp_path, proc) == 2**29 + 2**20
    assert memory_limits.cgroup_memory_headroom(tmp_path, "4:memory:/\n") is None


def test_host_memory_available_is_the_lower_of_meminfo_and_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    2000000 kB\n")
    _write(tmp_path / "cg" / "job", {"memory.max": f"{2**30}\n", "memory.current": "0\n"})
    assert memory_limits.host_memory_available(str(meminfo), tmp_path / "cg", "0::/job\n") \
        == (2**30, "the memory cgroup's limit less its usage")
    assert memory_limits.host_memory_available(str(meminfo), tmp_path / "cg", "0::/\n") \
        == (2000000 * 1024, "MemAvailable in /proc/meminfo")
