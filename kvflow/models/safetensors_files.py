"""A model folder's safetensors checkpoint: which files hold it (transformers' order of
preference), their tensor names, and their tensors read one file at a time. Every
safetensors file kvflow reads (model weights, LoRA adapters, draft heads) is read through
:func:`iter_safetensors_file`, so a bad file is one clear error wherever it is met."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files that hold the model, in transformers' order of preference:
    ``model.safetensors``; else the files ``model.safetensors.index.json`` maps tensors to (so
    a stale shard of an earlier save is not read over the current ones); else every top-level
    ``*.safetensors`` but ``consolidated*.safetensors`` (Mistral's own layout of the same
    weights, shipped next to the HF files in Mistral and Mixtral repos).

    Raises:
        ValueError: if the folder holds no such file, or its index cannot be read or names a
            file that is not there (an incomplete download).
    """
    single, index = os.path.join(folder, SINGLE_FILE), os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        return _indexed_files(folder, index)
    files = [path for path in sorted(glob.glob(os.path.join(folder, "*.safetensors")))
             if not os.path.basename(path).startswith("consolidated")]
    if not files:
        raise ValueError(f"model folder {folder!r} has no *.safetensors weight files")
    return files


def _indexed_files(folder: str, index: str) -> list[str]:
    """The files a safetensors index's ``weight_map`` names, sorted.

    Raises:
        ValueError: see :func:`checkpoint_files`.
    """
    try:
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot read {index!r} (a safetensors index with a \"weight_map\" "
                         f"object is expected): {e!r}") from None
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise ValueError(f"{index!r} names weight files that are not in the folder: "
                         f"{missing[:5]} (an incomplete download?)")
    return [os.path.join(folder, n) for n in names]


def checkpoint_tensor_names(folder: str) -> list[str]:
    """Names of every tensor in the folder's checkpoint files (:func:`checkpoint_files`), read
    from the safetensors headers only (no tensor data).

    Raises:
        ValueError: see :func:`checkpoint_files`, or naming a file that cannot be read or is
            not a safetensors file.
    """
    return list(checkpoint_tensor_headers(folder))


def checkpoint_tensor_headers(folder: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype such as ``"BF16"``, ``"I32"``) of every tensor in the
    folder's checkpoint files (:func:`checkpoint_files`), read from the safetensors headers
    only (no tensor data); a name in several files keeps its last file's entry.

    Raises:
        ValueError: see :func:`checkpoint_files`, or naming a file that cannot be read or is
            not a safetensors file.
    """
    from safetensors import SafetensorError

    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in checkpoint_files(folder):
        try:
            with _safe_open(path) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    info = f.get_slice(name)
                    headers[name] = (tuple(info.get_shape()), info.get_dtype())
        except SafetensorError as e:
            raise ValueError(f"weight file {path!r} is truncated or corrupt (not a complete "
                             f"safetensors file: {e}); download or copy it again") from None
        except OSError as e:
            raise ValueError(f"cannot read weight file {path!r}: {e.strerror or e}") from None
    return headers


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the folder's checkpoint files
    (:func:`checkpoint_files`).

    Raises:
        ValueError: see :func:`checkpoint_files`, or naming a file that cannot be read or is
            not a whole safetensors file (see :func:`iter_safetensors_file`).
    """
    for path in checkpoint_files(folder):
        yield from iter_safetensors_file(path)


def iter_safetensors_file(path: str, what: str = "weight file"
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of one .safetensors file (CPU tensors as stored).
    Every safetensors file kvflow reads (model weights, LoRA adapters) is read here, so a bad
    file is one clear error wherever it is met.

    Args:
        path: the file.
        what: what the file is, for the error (``"weight file"``, ``"LoRA adapter file"``).

    Raises:
        ValueError: naming the file when it cannot be read (missing, a folder, no permission)
            or is not a whole safetensors file (truncated, e.g. by an interrupted download, or
            corrupt).
    """
    from safetensors import SafetensorError

    try:
        with _safe_open(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)
    except SafetensorError as e:
        raise ValueError(f"{what} {path!r} is truncated or corrupt (not a complete "
                         f"safetensors file: {e}); download or copy it again") from None
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


def _safe_open(path: str) -> Any:
    """safetensors' ``safe_open(path, framework="pt")``, after a plain ``open`` so that a file
    that cannot be opened raises the true OSError: safetensors reports every failure to open
    (no permission, a folder) as FileNotFoundError "No such file or directory"."""
    from safetensors import safe_open

    with open(path, "rb"):
        pass
    return safe_open(path, framework="pt")
