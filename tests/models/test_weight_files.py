"""A model folder whose safetensors file is cut short (an interrupted download or copy) or
cannot be read is refused with a ValueError naming the file, and ``kvflow generate`` prints it
as one line with status 2, not a safetensors traceback. The files read are those transformers
reads: the shards ``model.safetensors.index.json`` names (not a stale shard beside them), and
never Mistral's ``consolidated.safetensors``; a tensor stored in two of them loads the copy the
index names (else the later file's); outputs checked against transformers."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.entrypoints.cli import main


def _truncated_copy(src: str, dst: str, size: int) -> str:
    shutil.copytree(src, dst)
    weights = os.path.join(dst, "model.safetensors")
    os.truncate(weights, size if size > 0 else os.path.getsize(weights) // 2)
    return weights


@pytest.mark.parametrize("size", [0, 500, 4], ids=["half", "500_bytes", "4_bytes"])
def test_truncated_weights_are_one_cli_line(tiny_llama, tmp_path, capsys, size):
    """Half the file (header whole, data cut), 500 bytes (header cut), 4 bytes (no header)."""
    weights = _truncated_copy(tiny_llama.path, str(tmp_path / "model"), size)
    rc = main(["generate", "--model", str(tmp_path / "model"), "--prompt", "Hi",
               "--max-tokens", "1", "--device", "cpu"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvflow: error: weight file ")
    assert repr(weights) in lines[0] and "truncated or corrupt" in lines[0]


def test_truncated_weights_raise_value_error(tiny_llama, tmp_path):
    weights = _truncated_copy(tiny_llama.path, str(tmp_path / "model"), 1000)
    with pytest.raises(ValueError, match="truncated or corrupt") as exc:
        LLM(model=str(tmp_path / "model"), dtype="float32", device="cpu", num_kv_blocks=8)
    assert repr(weights) in str(exc.value)


def test_unreadable_weight_file_is_named(tmp_path):
    from kvflow.models.safetensors_files import iter_safetensors_file

    folder = tmp_path / "dir.safetensors"  # a folder where a file should be
    folder.mkdir()
    with pytest.raises(ValueError, match=f"cannot read weight file {str(folder)!r}"):
        list(iter_safetensors_file(str(folder)))
    with pytest.raises(ValueError, match="cannot read LoRA adapter file .*missing"):
        list(iter_safetensors_file(str(tmp_path / "missing.safetensors"), "LoRA adapter file"))


def _assert_matches_hf(path: str, tiny) -> None:
    """kvflow on ``path`` gives the prompt logprobs of transformers' model ``tiny``."""
    prompt = list(range(5, 25))
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)
    with torch.no_grad():
        ref = torch.log_softmax(tiny.hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    assert got == pytest.approx([float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))],
                                abs=1e-4)


def test_consolidated_file_beside_the_hf_weights_is_not_read(tiny_llama, tmp_path):
    """Mistral repos ship ``consolidated.safetensors`` (their own tensor names) next to the HF
    files; a whole-repo download has both."""
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_llama.path, str(tmp_path / "model"))
    weights = load_file(os.path.join(path, "model.safetensors"))
    save_file({n.replace("model.layers.", "layers.").replace("self_attn.q_proj", "attention.wq"):
               t.clone() for n, t in weights.items()}, os.path.join(path, "consolidated.safetensors"))
    _assert_matches_hf(path, tiny_llama)


def _sharded_copy(tiny, folder: str) -> str:
    tiny.hf_model.save_pretrained(folder, max_shard_size="100KB")
    for name in os.listdir(tiny.path):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny.path, name), folder)
    return folder


@pytest.mark.parametrize("sharded", [True, False], ids=["index", "single_file"])
def test_stale_file_of_an_earlier_save_is_not_read(tiny_llama, tmp_path, sharded):
    """A file of an earlier save left in the folder (same tensor names, other values) is not
    read: only the files the index maps tensors to, or ``model.safetensors`` alone."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "model")
    if sharded:
        _sharded_copy(tiny_llama, path)
    else:
        shutil.copytree(tiny_llama.path, path)
    files = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(files) > 1 if sharded else files == ["model.safetensors"]
    stale = {n: torch.randn_like(t) for name in files
             for n, t in load_file(os.path.join(path, name)).items()}
    save_file(stale, os.path.join(path, "model_zz_old.safetensors"))
    _assert_matches_hf(path, tiny_llama)


def test_index_naming_a_missing_shard_is_named(tiny_llama, tmp_path):
    path = _sharded_copy(tiny_llama, str(tmp_path / "model"))
    gone = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, gone))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json' names weight files "
                                         rf"that are not in the folder: \['{gone}'\]"):
        LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)


def _stored_twice(tiny, folder: str, into_later: bool) -> tuple[str, str, torch.Tensor]:
    """A sharded copy of ``tiny`` in which one tensor of a shard is also stored, with other
    values, in the next shard (``into_later``) or the one before (files of two saves mixed);
    returns (name, path of the file holding the stale copy, stale copy)."""
    from safetensors.torch import load_file, save_file

    _sharded_copy(tiny, folder)
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    assert len(files) > 2
    owner, other = (files[0], files[1]) if into_later else (files[1], files[0])
    name = min(n for n in load_file(os.path.join(folder, owner)) if n.endswith("_proj.weight"))
    tensors = load_file(os.path.join(folder, other))
    stale = tensors[name] = torch.randn_like(load_file(os.path.join(folder, owner))[name])
    save_file(tensors, os.path.join(folder, other), metadata={"format": "pt"})
    return name, os.path.join(folder, other), stale


@pytest.mark.parametrize("into_later", [True, False], ids=["stale_in_later", "stale_in_earlier"])
def test_tensor_stored_in_two_shards_loads_the_index_copy(tiny_llama, tmp_path, into_later):
    """Both copies used to load, the later file's winning whatever the index says (as
    transformers 5.25 and vLLM load them); now the copy in the file the index's weight_map names
    loads, the other is ignored."""
    _stored_twice(tiny_llama, str(tmp_path / "model"), into_later)
    _assert_matches_hf(str(tmp_path / "model"), tiny_llama)


def test_index_naming_a_file_without_the_tensor_loads_the_stored_copy(tiny_llama, tmp_path):
    """An index mapping a tensor to a shard that lacks it (the shard is still read): the copy
    another shard holds loads, as before, rather than a missing weight."""
    import json

    from safetensors.torch import load_file

    path = _sharded_copy(tiny_llama, str(tmp_path / "model"))
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    files = sorted(set(data["weight_map"].values()))
    name = min(load_file(os.path.join(path, files[0])))
    data["weight_map"][name] = files[1]
    with open(index, "w") as f:
        json.dump(data, f)
    _assert_matches_hf(path, tiny_llama)


def test_tensor_stored_in_two_files_without_an_index_loads_the_later_copy(tiny_llama, tmp_path):
    """No index to say which copy is right: the later file's loads, as transformers and vLLM
    load such a folder. Oracle: the transformers model with that weight replaced."""
    import copy

    path = str(tmp_path / "model")
    name, _, stale = _stored_twice(tiny_llama, path, into_later=True)
    os.remove(os.path.join(path, "model.safetensors.index.json"))
    hf_model = copy.deepcopy(tiny_llama.hf_model)
    with torch.no_grad():
        hf_model.get_parameter(name).copy_(stale)
    _assert_matches_hf(path, SimpleNamespace(hf_model=hf_model))
