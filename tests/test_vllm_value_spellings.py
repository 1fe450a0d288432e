"""vLLM's spellings of kvflow's values, from a ``vllm serve`` command line, a ``--config``
file or ``LLM(...)`` keywords: ``--dtype half`` / ``float`` (float16 / float32, vLLM's
``ModelDType``), ``--generation-config vllm`` (kvflow's ``none``: no generation_config.json
defaults) and ``--load-format safetensors`` (a folder's safetensors files, as ``auto`` reads
them; refused for a GGUF file or a folder without them); vLLM's ``--load-format pt`` is
refused naming it (kvflow reads no PyTorch checkpoint)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.config.model import ModelConfig
from kvflow.distributed.kv_transfer.storage_keys import model_identity
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.config_file import expand_config_file
from kvflow.models.loader import load_hf_config, load_model
from kvflow.models.model_resolver import ModelSource
from tests.test_generation_config import GEN_DEFAULTS, with_generation_config


def _model_config(*argv: str) -> ModelConfig:
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["serve", "m", *argv]))
    return EngineConfig.from_cli_args(args).model_config


@pytest.mark.parametrize("vllm_value, kvflow_value", [("half", "float16"),
                                                      ("float", "float32")])
def test_dtype_spellings_on_every_path(tmp_path, vllm_value, kvflow_value):
    path = tmp_path / "serve.yaml"
    path.write_text(f"dtype: {vllm_value}\n")
    assert _model_config("--dtype", vllm_value).dtype == kvflow_value
    assert _model_config("--config", str(path)).dtype == kvflow_value
    assert EngineConfig.from_kwargs(dtype=vllm_value).model_config.dtype == kvflow_value
    assert _model_config("--dtype", "bfloat16").dtype == "bfloat16"  # kvflow's own stay


def test_llm_half_computes_in_float16(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="half", num_kv_blocks=32, block_size=4)
    assert llm.engine.core.dtype == torch.float16
    runner = llm.engine.core.executor.runner
    assert runner.model.model.embed_tokens.weight.dtype == torch.float16


def test_generation_config_vllm_is_none(tiny_llama, tmp_path):
    model = with_generation_config(tiny_llama.path, tmp_path / "m", GEN_DEFAULTS)
    assert _model_config("--generation-config", "vllm").generation_config == "none"
    kw = {"model": model, "dtype": "float32", "num_kv_blocks": 32, "block_size": 4}
    assert LLM(**kw).engine.sampling_defaults  # the file's defaults are read ...
    assert LLM(**kw, generation_config="vllm").engine.sampling_defaults == {}  # ... not here


def _hf_greedy(tiny, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                     eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_load_format_safetensors_loads_the_folder(tiny_llama):
    assert _model_config("--load-format", "safetensors").load_format == "safetensors"
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=32, block_size=4,
              load_format="safetensors")
    ids = llm.get_tokenizer().encode("the quick brown fox")
    (out,) = llm.generate({"prompt_token_ids": ids},
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    assert list(out.outputs[0].token_ids) == _hf_greedy(tiny_llama, ids, 6)


def test_load_format_safetensors_refuses_other_weights(tiny_llama, tmp_path):
    folder = tmp_path / "bin_only"
    shutil.copytree(tiny_llama.path, folder)
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            os.remove(folder / name)
    with pytest.raises(ValueError) as err:
        LLM(model=str(folder), dtype="float32", num_kv_blocks=32, block_size=4,
            load_format="safetensors")
    assert "load_format='safetensors': model folder" in str(err.value)
    assert "has no *.safetensors weight files" in str(err.value)
    gguf = ModelSource(kind="gguf", path=str(tmp_path / "m.gguf"), name="m")
    hf_config = load_hf_config(ModelSource(kind="hf", path=tiny_llama.path, name="m"))
    with pytest.raises(ValueError, match=r"is a GGUF file, not safetensors; give "
                                         r"--load-format auto"):
        load_model(gguf, hf_config, None, torch.float32, torch.device("cpu"), "safetensors")


def test_load_format_pt_is_refused_naming_it(capsys):
    with pytest.raises(ValueError, match=r"load_format='pt' is not available: kvflow reads a "
                                         r"model's weights from safetensors files or a "
                                         r"\.gguf file"):
        EngineConfig.from_kwargs(load_format="pt")
    assert main(["serve", "m", "--load-format", "pt"]) == 2
    assert "--load-format='pt' is not available" in capsys.readouterr().err


def test_safetensors_and_auto_name_the_same_model_for_shared_kv(tiny_llama):
    """The shared-storage KV connector keys blocks by the model: both formats read the same
    files, so they share the stored KV (a dummy model does not)."""
    hf_config = load_hf_config(ModelSource(kind="hf", path=tiny_llama.path, name="m"))

    def identity(load_format: str) -> str:
        return model_identity(tiny_llama.path, hf_config, torch.float32,
                              ModelConfig(load_format=load_format))

    assert identity("safetensors") == identity("auto") != identity("dummy")
