"""A model folder whose safetensors file is cut short (an interrupted download or copy) or
cannot be read is refused with a ValueError naming the file, and ``kvflow generate`` prints it
as one line with status 2, not a safetensors traceback."""

from __future__ import annotations

import os
import shutil

import pytest

from kvflow import LLM
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
    from kvflow.models.loader import iter_safetensors_file

    folder = tmp_path / "dir.safetensors"  # a folder where a file should be
    folder.mkdir()
    with pytest.raises(ValueError, match=f"cannot read weight file {str(folder)!r}"):
        list(iter_safetensors_file(str(folder)))
    with pytest.raises(ValueError, match="cannot read LoRA adapter file .*missing"):
        list(iter_safetensors_file(str(tmp_path / "missing.safetensors"), "LoRA adapter file"))
