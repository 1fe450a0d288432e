"""A broken model folder or path is one ``ValueError`` naming the file and the field or reason,
raised before any weights load (the CLI turns it into one ``kvflow: error:`` line, exit 2):
never a traceback from torch, a message about something else, or a half-built engine."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from kvflow import LLM


def _llm(path: str) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)


def _config_copy(tiny, folder, remove=(), **changes) -> str:
    """A copy of the tiny model's folder with ``changes`` set in / ``remove`` dropped from its
    config.json; returns the config.json path."""
    path = shutil.copytree(tiny.path, str(folder))
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    for name in remove:
        del config[name]
    with open(config_path, "w") as f:
        json.dump(config, f)
    return config_path


# The tiny Llama: hidden 64, 2 layers, 4 heads, 2 KV heads. Before the check: transformers' 4096
# default then "The hidden size (4096) is not a multiple ..."; the default 32 layers then
# "lacks weights for layers 2-31"; "pipeline_parallel_size=1 exceeds the model's 0 layers";
# torch's RuntimeError "negative dimension"; "integer modulo by zero"; "rotary: positions must
# lie in [0, 0)"; a k_proj shape mismatch instead of the head counts.
@pytest.mark.parametrize("remove, changes, reason", [
    (("hidden_size",), {}, "has no 'hidden_size'; kvflow needs it"),
    (("num_hidden_layers",), {}, "has no 'num_hidden_layers'; kvflow needs it"),
    ((), {"num_hidden_layers": 0}, ": num_hidden_layers=0 is invalid; it must be a positive"),
    ((), {"num_hidden_layers": -1}, ": num_hidden_layers=-1 is invalid"),
    ((), {"hidden_size": -64}, ": hidden_size=-64 is invalid; it must be a positive integer"),
    ((), {"hidden_size": "64"}, ": hidden_size='64' is invalid"),
    ((), {"num_attention_heads": 0}, ": num_attention_heads=0 is invalid"),
    ((), {"vocab_size": 0}, ": vocab_size=0 is invalid"),
    ((), {"max_position_embeddings": 0}, ": max_position_embeddings=0 is invalid"),
    ((), {"num_key_value_heads": 3},
     ": num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    # was torch's "DefaultCPUAllocator: can't allocate memory: you tried to allocate
    # 4398046511104 bytes" for the rotary table (a value it could allocate was computed and
    # filled at start-up: the process was killed for memory)
    ((), {"max_position_embeddings": 2**40},
     ": max_position_embeddings=1099511627776 is above the 16777216 positions kvflow tables"),
], ids=["no_hidden_size", "no_layers", "zero_layers", "negative_layers", "negative_hidden",
        "string_hidden", "zero_heads", "zero_vocab", "max_positions_0", "kv_heads_not_dividing",
        "max_positions_2e40"])
def test_bad_config_size_is_named(tiny_llama, tmp_path, remove, changes, reason):
    config_path = _config_copy(tiny_llama, tmp_path / "model", remove, **changes)
    with pytest.raises(ValueError) as info:
        _llm(os.path.dirname(config_path))
    assert str(info.value).startswith(f"model config {config_path!r}")
    assert reason in str(info.value)


def test_invalid_json_names_the_line_and_column(tiny_llama, tmp_path):
    config_path = _config_copy(tiny_llama, tmp_path / "model")
    with open(config_path, "w") as f:
        f.write('{"hidden_size": 64,')
    with pytest.raises(ValueError, match=re.escape(
            f"model config {config_path!r} is not valid JSON: Expecting property name enclosed "
            "in double quotes: line 1 column 20 (char 19)")):
        _llm(os.path.dirname(config_path))


def test_transformers_validation_error_keeps_its_reason(tiny_llama, tmp_path):
    """transformers' own check (hidden size a multiple of the heads) puts its reason on the
    second line of the message; the one-line error used to stop at "validator
    'validate_architecture':"."""
    config_path = _config_copy(tiny_llama, tmp_path / "model", num_attention_heads=3,
                               num_key_value_heads=3)
    with pytest.raises(ValueError) as info:
        _llm(os.path.dirname(config_path))
    assert str(info.value).startswith(f"cannot read model config {config_path!r}: ")
    assert "The hidden size (64) is not a multiple of the number of attention heads (3)" \
        in str(info.value)


def test_integer_weight_in_unquantized_checkpoint_is_refused(tiny_llama, tmp_path):
    """An int32 q_proj in a checkpoint without quantization_config was copied into the float
    parameter (integer-rounded weights) and the model generated text from it."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_llama.path, str(tmp_path / "model"))
    weights_path = os.path.join(folder, "model.safetensors")
    weights = load_file(weights_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = weights[name].to(torch.int32)
    save_file(weights, weights_path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(
            f"checkpoint tensor {name!r} in {folder!r} has dtype torch.int32; the model has no "
            "quantization (config.json has no quantization_config), so its weights must be "
            "floating point")):
        _llm(folder)


def _check_refused_without(model: str, tmp_path, dropped: tuple[str, ...],
                           quantization: str | None) -> None:
    """A copy of ``model``'s folder without the checkpoint tensors ``dropped`` is refused by
    ``LLM``, the error naming them (sorted)."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(model, str(tmp_path / "model"))
    weights_path = os.path.join(folder, "model.safetensors")
    weights = load_file(weights_path)
    for name in dropped:
        del weights[name]
    save_file(weights, weights_path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(
            f"checkpoint {folder!r} lacks weights for {sorted(dropped)}")):
        LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4,
            quantization=quantization)


@pytest.mark.parametrize("arch, dropped, quantization", [
    ("llama", ("model.layers.0.self_attn.k_proj.weight",), None),
    ("llama", ("model.layers.1.mlp.up_proj.weight",), "int8"),
    ("qwen2", ("model.layers.1.self_attn.v_proj.bias",), None),
    ("qwen2", ("model.layers.0.self_attn.q_proj.weight",
               "model.layers.0.mlp.gate_proj.weight"), None),
], ids=["k_proj", "up_proj-int8", "v_proj-bias", "two-parts"])
def test_checkpoint_without_one_part_of_a_fused_layer_is_refused(tiny_model_factory, tmp_path,
                                                                 arch, dropped, quantization):
    """kvflow fuses q/k/v into qkv_proj and gate/up into gate_up_proj: a checkpoint that lacks
    one of the parts loaded the others and ran with the missing part's rows left as the
    uninitialized memory they were allocated with (garbage text, no error: a parameter counted
    as loaded once any part reached it). Now the missing tensors are named, as for a missing
    unfused weight."""
    _check_refused_without(tiny_model_factory(arch).path, tmp_path, dropped, quantization)


@pytest.mark.parametrize("dropped", [
    ("model.layers.0.block_sparse_moe.experts.1.w2.weight",),
    ("model.layers.1.block_sparse_moe.experts.3.w3.weight",
     "model.layers.1.block_sparse_moe.experts.0.w1.weight"),
], ids=["one-down", "gate-and-up"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_checkpoint_without_one_experts_tensor_is_refused(tiny_model_factory, tmp_path,
                                                          dropped, quantization):
    """Mixtral's checkpoint holds one tensor per expert and projection (w1/w3/w2), stacked by
    kvflow into w13_weight / w2_weight: one expert's tensor missing left its slice of the
    stack uninitialized (garbage text, no error). Now it is named as stored."""
    _check_refused_without(tiny_model_factory("mixtral").path, tmp_path, dropped, quantization)


def test_encoder_checkpoint_without_its_key_projection_is_refused(tiny_tokenizer, tmp_path):
    """BERT's query/key/value load into one qkv_proj: a checkpoint without one layer's key
    ran with those rows uninitialized; now the missing tensor is named."""
    from safetensors.torch import load_file, save_file

    from tests.models.embedding_models import build_bert

    folder = str(tmp_path / "bert")
    build_bert(tiny_tokenizer, folder, "mean")
    weights_path = os.path.join(folder, "model.safetensors")
    weights = load_file(weights_path)
    (name,) = [n for n in weights if n.endswith("layer.1.attention.self.key.weight")]
    del weights[name]
    save_file(weights, weights_path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(
            "lacks weights for ['encoder.layer.1.attention.self.key.weight']")):
        LLM(model=folder, dtype="float32", device="cpu")


@pytest.mark.parametrize("target", ["loop", "missing"])
def test_symlink_that_leads_nowhere_is_named(tmp_path, target):
    """Was "does not exist (no such file or directory)", though the path is right there."""
    link = tmp_path / "model"
    os.symlink(tmp_path / "model" if target == "loop" else tmp_path / "gone", link)
    with pytest.raises(ValueError) as info:
        _llm(str(link))
    assert str(info.value) == (
        f"Model path {str(link)!r} is a symbolic link that leads nowhere (a link loop, or its "
        f"target {os.readlink(link)!r} does not exist)")


def test_unreadable_model_folder_is_named(tiny_llama, tmp_path, monkeypatch):
    """A folder without read permission (chmod 000): its config.json looks absent, and listing
    it raised PermissionError with a traceback. Tests may run as root, whom chmod does not stop,
    so the listing's PermissionError is simulated."""
    folder = str(tmp_path / "model")
    os.mkdir(folder)
    real_listdir = os.listdir

    def listdir(path):
        if os.fspath(path) == folder:
            raise PermissionError(13, "Permission denied", path)
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    with pytest.raises(ValueError, match=re.escape(
            f"Model directory {folder!r} cannot be read: Permission denied")):
        _llm(folder)


def test_weight_file_that_cannot_be_opened_says_why(tmp_path):
    """safetensors reports any failure to open as "No such file or directory"; the error now
    gives the real reason (here a folder where the file should be; a chmod 000 file gives
    "Permission denied" the same way)."""
    from kvflow.models.safetensors_files import iter_safetensors_file

    path = str(tmp_path / "model.safetensors")
    os.mkdir(path)
    with pytest.raises(ValueError) as info:
        list(iter_safetensors_file(path))
    assert str(info.value) == f"cannot read weight file {path!r}: Is a directory"


def _deny_open(monkeypatch, path: str) -> None:
    """Python's ``open`` of ``path`` fails as a chmod 000 file does for a user (root, as CI
    runs, reads such a file anyway, so the permission is simulated)."""
    import builtins

    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if os.fspath(file) == path:
            raise PermissionError(13, "Permission denied", path)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)


def test_weight_file_without_permission_says_so(tiny_llama, monkeypatch):
    """safetensors reports every failure to open as "No such file or directory"; the loader
    opens the file itself first, so the true reason is named."""
    from kvflow.models.safetensors_files import iter_safetensors_file

    path = os.path.join(tiny_llama.path, "model.safetensors")
    _deny_open(monkeypatch, path)
    with pytest.raises(ValueError) as info:
        list(iter_safetensors_file(path))
    assert str(info.value) == f"cannot read weight file {path!r}: Permission denied"


def test_model_folder_without_tokenizer_files_says_so(tiny_llama, tmp_path):
    """Was transformers' "Couldn't instantiate the backend tokenizer from one of:" (cut there
    in the one-line error), whose full text suggests installing sentencepiece."""
    folder = shutil.copytree(tiny_llama.path, str(tmp_path / "model"))
    os.remove(os.path.join(folder, "tokenizer.json"))
    with pytest.raises(ValueError) as info:
        _llm(folder)
    assert str(info.value) == (
        f"cannot load a tokenizer from {folder!r}: the folder has no tokenizer file (one of "
        "tokenizer.json, tokenizer.model, vocab.json, vocab.txt); pass a tokenizer with "
        "--tokenizer (LLM(tokenizer=...))")


def test_truncated_tokenizer_json_is_named(tiny_llama, tmp_path):
    """Was "cannot load a tokenizer from <folder>: Expecting value: line 1 column ...", naming
    neither the file nor what is wrong with it."""
    folder = shutil.copytree(tiny_llama.path, str(tmp_path / "model"))
    path = os.path.join(folder, "tokenizer.json")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError) as info:
        _llm(folder)
    message = str(info.value)
    assert message.startswith(f"cannot load a tokenizer from {folder!r}: {path!r} is not valid "
                              "JSON, truncated or corrupt (")
    assert message.endswith("); pass a tokenizer with --tokenizer (LLM(tokenizer=...))")


@pytest.mark.parametrize("name, text, reason", [
    ("tokenizer_config.json", "[]", "is not a JSON object (it is a list)"),
    ("tokenizer.json", "[]", "is not a JSON object (it is a list)"),
    ("tokenizer.json", "{}", ('has no "model" object (the tokenizer\'s vocabulary and '
                              "algorithm): not a whole tokenizers file")),
], ids=["config_list", "tokenizer_list", "tokenizer_without_model"])
def test_tokenizer_file_of_the_wrong_shape_is_named(tiny_llama, tmp_path, name, text, reason):
    """Valid JSON of the wrong shape was transformers' own words: "'list' object has no
    attribute 'get'", "'str' object cannot be interpreted as an integer", or the bare key
    "'added_tokens'", naming neither the file nor what is wrong with it."""
    folder = shutil.copytree(tiny_llama.path, str(tmp_path / "model"))
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ValueError) as info:
        _llm(folder)
    assert str(info.value) == (f"cannot load a tokenizer from {folder!r}: {path!r} {reason}; "
                               "pass a tokenizer with --tokenizer (LLM(tokenizer=...))")


def test_unreadable_tokenizer_json_says_so(tiny_llama, monkeypatch):
    """Named with the OS reason, not called "not valid JSON" (``load_tokenizer`` puts this
    reason after "cannot load a tokenizer from <folder>: ")."""
    from kvflow.models.tokenizer_files import tokenizer_files_problem

    path = os.path.join(tiny_llama.path, "tokenizer.json")
    _deny_open(monkeypatch, path)
    assert tokenizer_files_problem(tiny_llama.path) == f"{path!r} cannot be read: Permission denied"


def _spy_weight_reads(monkeypatch) -> list[str]:
    """The weight files read from now on (every checkpoint file passes through
    ``safetensors_files.iter_safetensors_file``), in order."""
    from kvflow.models import safetensors_files

    read: list[str] = []
    real = safetensors_files.iter_safetensors_file

    def spy(path, *args, **kwargs):
        read.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors_files, "iter_safetensors_file", spy)
    return read


def test_truncated_tokenizer_json_fails_before_the_weights_load(tiny_llama, tmp_path,
                                                                  monkeypatch):
    """The offline engine loaded every weight (EngineCore) before it looked at the tokenizer,
    so a broken tokenizer.json was reported only after the whole weight load."""
    folder = shutil.copytree(tiny_llama.path, str(tmp_path / "model"))
    read = _spy_weight_reads(monkeypatch)
    _llm(folder).shutdown()  # the spy sees the weights of an intact copy
    assert read == [os.path.join(folder, "model.safetensors")]
    read.clear()
    path = os.path.join(folder, "tokenizer.json")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(
            f"cannot load a tokenizer from {folder!r}: {path!r} is not valid JSON")):
        _llm(folder)
    assert read == []


def test_served_model_with_invalid_config_json_is_named_before_any_core_loads(
        tiny_llama, tmp_path, monkeypatch, capsys):
    """``kvflow serve`` started the core processes, then loaded the tokenizer in the API
    process; transformers read the broken config.json to pick the tokenizer class, so the
    server exited with "cannot load a tokenizer from <folder>: It looks like the config file
    ... is not a valid JSON file", without the line and column. The cores now start gated
    (they import the engine while config.json is checked) and are never let load it."""
    import socket

    from kvflow.engine.replica_set import ReplicaSet
    from kvflow.entrypoints.cli import main

    def no_release(self):
        raise AssertionError("the core processes were let load the model")

    started = []
    monkeypatch.setattr(ReplicaSet, "start", lambda self, gated=False: started.append(gated))
    monkeypatch.setattr(ReplicaSet, "release", no_release)
    config_path = _config_copy(tiny_llama, tmp_path / "model")
    with open(config_path, "w") as f:
        f.write('{"hidden_size": 64,')
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    rc = main(["serve", os.path.dirname(config_path), "--port", port, "--device", "cpu"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2, err
    assert err[-1] == (f"kvflow: error: model config {config_path!r} is not valid JSON: "
                       "Expecting property name enclosed in double quotes: line 1 column 20 "
                       "(char 19)"), err
    assert started == [True]
