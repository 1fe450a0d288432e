"""A model folder's safetensors checkpoint: which files hold it (transformers' order of
preference), their tensor names, and their tensors read one file at a time. Every
safetensors file kvflow reads (model weights, LoRA adapters, draft heads) is read through
:func:`iter_safetensors_file`, so a bad file is one clear error wherever it is met."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Collection, Iterator
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
    return _checkpoint(folder)[0]


def _checkpoint(folder: str) -> tuple[list[str], dict[str, str]]:
    """(:func:`checkpoint_files`, name -> path of the file the index's ``weight_map`` names
    for it); the map is empty unless the files come from ``model.safetensors.index.json``.

    Raises:
        ValueError: see :func:`checkpoint_files`.
    """
    single, index = os.path.join(folder, SINGLE_FILE), os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        return [single], {}
    if os.path.isfile(index):
        weight_map = _read_weight_map(folder, index)
        return sorted(set(weight_map.values())), weight_map
    files = [path for path in sorted(glob.glob(os.path.join(folder, "*.safetensors")))
             if not os.path.basename(path).startswith("consolidated")]
    if not files:
        raise ValueError(f"model folder {folder!r} has no *.safetensors weight files")
    return files, {}


def _read_weight_map(folder: str, index: str) -> dict[str, str]:
    """A safetensors index's ``weight_map``: tensor name -> path of its file in ``folder``.

    Raises:
        ValueError: see :func:`checkpoint_files`.
    """
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
        weight_map = {tensor: os.path.join(folder, name) for tensor, name in weight_map.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot read {index!r} (a safetensors index with a \"weight_map\" "
                         f"object is expected): {e!r}") from None
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise ValueError(f"{index!r} names weight files that are not in the folder: "
                         f"{missing[:5]} (an incomplete download?)")
    return weight_map


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
    only (no tensor data); a name in several files keeps the entry of the copy that loads
    (:func:`checkpoint_file_headers`).

    Raises:
        ValueError: see :func:`checkpoint_files`, or naming a file that cannot be read or is
            not a safetensors file.
    """
    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for _, file_headers in checkpoint_file_headers(folder):
        headers.update(file_headers)
    return headers


def checkpoint_file_headers(folder: str
                            ) -> list[tuple[str, dict[str, tuple[tuple[int, ...], str]]]]:
    """(path, name -> (shape, safetensors dtype)) for each of the folder's checkpoint files
    (:func:`checkpoint_files`), in order, holding the tensors loaded from that file.

    A tensor stored in several files (files of two saves mixed in one folder) loads one copy:
    with ``model.safetensors.index.json``, the copy in the file its ``weight_map`` names (the
    index is the checkpoint's own statement; the other copies are left out here), unless that
    file does not hold it; otherwise every copy is listed and loads in file order, the later
    file's winning, as transformers and vLLM load a folder without an index.

    Raises:
        ValueError: see :func:`checkpoint_files`, or naming a file that cannot be read or is
            not a safetensors file.
    """
    files, weight_map = _checkpoint(folder)
    per_file = [(path, _file_headers(path)) for path in files]
    held = {(path, name) for path, headers in per_file for name in headers}
    return [(path, {name: header for name, header in headers.items()
                    if weight_map.get(name, path) == path
                    or (weight_map[name], name) not in held})
            for path, headers in per_file]


def _file_headers(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor in one file, from its header.

    Raises:
        ValueError: naming the file when it cannot be read or is not a safetensors file.
    """
    from safetensors import SafetensorError

    headers: dict[str, tuple[tuple[int, ...], str]] = {}
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
    (:func:`checkpoint_files`); a tensor stored in several files is yielded as
    :func:`checkpoint_file_headers` lists it (the index's copy, or each copy in file order).

    Raises:
        ValueError: see :func:`checkpoint_files`, or naming a file that cannot be read or is
            not a whole safetensors file (see :func:`iter_safetensors_file`).
    """
    for path, headers in checkpoint_file_headers(folder):
        yield from iter_safetensors_file(path, names=headers.keys())


def iter_safetensors_file(path: str, what: str = "weight file",
                          names: Collection[str] | None = None
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of one .safetensors file (CPU tensors as stored),
    or only for those in ``names`` (the others are not read).
    Every safetensors file kvflow reads (model weights, LoRA adapters) is read here, so a bad
    file is one clear error wherever it is met.

    Args:
        path: the file.
        what: what the file is, for the error (``"weight file"``, ``"LoRA adapter file"``).
        names: the tensors to yield; None: all of them.

    Raises:
        ValueError: naming the file when it cannot be read (missing, a folder, no permission)
            or is not a whole safetensors file (truncated, e.g. by an interrupted download, or
            corrupt).
    """
    from safetensors import SafetensorError

    try:
        with _safe_open(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if names is None or name in names:
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
