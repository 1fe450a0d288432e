"""Hugging Face Hub model names (``org/name[@revision]``) resolved to a local snapshot folder.

Downloads go through ``huggingface_hub.snapshot_download`` into its cache (``$HF_HUB_CACHE``,
by default ``$HF_HOME/hub``, or the ``download_dir`` given), laid out as
``models--org--name/{blobs, snapshots/<commit>/..., refs/<branch or tag>}``, with
huggingface_hub's own tqdm progress bars. ``HF_HUB_OFFLINE=1`` (read by huggingface_hub when it
is first imported) forbids network access: a cached snapshot is used, an uncached one is a
``ValueError``.

Only what kvflow loads is fetched, in two passes:

1. the top-level metadata: ``config.json``, ``generation_config.json``, the tokenizer files
   (``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer.model``, ``vocab``/``merges``,
   ``*.jinja`` chat templates) and ``model.safetensors.index.json``;
2. the weights: the ``*.safetensors`` files that the index's ``weight_map`` names (so a repo
   that also ships a ``consolidated.safetensors`` in another layout downloads one copy), or,
   without an index, every top-level ``*.safetensors`` but ``consolidated*``. The second pass
   asks for the commit the first one resolved, so both see the same revision.
"""

from __future__ import annotations

import json
import os
import re

_METADATA_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt",
                      "vocab.txt"]
_TOP_LEVEL_ONLY = ["*/*"]  # fnmatch's * crosses "/": this drops files in sub-folders
_INDEX_FILE = "model.safetensors.index.json"
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[^\s@]+)?")


def parse_hub_name(model: str) -> tuple[str, str | None] | None:
    """Split ``"org/name@revision"`` into ``("org/name", "revision")`` (revision None when
    absent); None when ``model`` is not shaped like a Hub repo id (one ``/``, the characters
    the Hub allows, checked with ``huggingface_hub.utils.validate_repo_id``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    model = model.strip()
    if not _HUB_NAME.fullmatch(model):
        return None
    repo_id, _, revision = model.partition("@")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def hub_cache_dir(download_dir: str | None) -> str:
    """Where snapshots live: ``download_dir`` if given, else huggingface_hub's cache
    (``$HF_HUB_CACHE``, by default ``$HF_HOME/hub``, by default ``~/.cache/huggingface/hub``)."""
    from huggingface_hub import constants

    return os.path.expanduser(download_dir) if download_dir else constants.HF_HUB_CACHE


def download_snapshot(repo_id: str, revision: str | None, download_dir: str | None,
                      token: str | bool | None = None) -> str:
    """Download (or find in the cache) what kvflow needs of a Hub model repo; returns the
    snapshot folder (``.../models--org--name/snapshots/<commit>``).

    Args:
        repo_id: ``"org/name"``.
        revision: a branch, tag or commit hash; None for ``main``.
        download_dir: the huggingface_hub cache folder to use (None: its default).
        token: the Hub token (vLLM's ``hf_token``): a token, True for the one ``hf auth
            login`` stored, None for huggingface_hub's default (``$HF_TOKEN``, else the
            stored one).

    Raises:
        ValueError: one line saying why: offline (``HF_HUB_OFFLINE=1``) or the Hub unreachable
            and the snapshot not cached; no such repo (or private/gated without a token); no
            such revision; an incomplete cached snapshot; a repo without ``config.json`` (naming
            its ``.gguf`` files, if any, to pass by path) or without ``*.safetensors`` weights.
    """
    cache = hub_cache_dir(download_dir)
    where = f"{repo_id!r} (revision {revision or 'main'!r})"
    folder = _snapshot(repo_id, revision, cache, where, _METADATA_PATTERNS, _TOP_LEVEL_ONLY,
                       token=token)
    allow, ignore = _weight_patterns(folder)
    if not _weights_cached(folder, allow, ignore):  # else no second Hub request (and no
        # retries against an unreachable Hub for a snapshot that is all there)
        folder = _snapshot(repo_id, os.path.basename(folder), cache, where, allow, ignore,
                           token=token)
    _check_snapshot(folder, where, repo_id)
    return folder


def download_tokenizer(repo_id: str, revision: str | None, download_dir: str | None,
                       token: str | bool | None = None) -> str:
    """Download (or find in the cache) the tokenizer files of a Hub repo (the metadata pass of
    :func:`download_snapshot`: no weights, no ``config.json`` needed; ``token`` as there);
    returns the snapshot folder.

    Raises:
        ValueError: one line saying why, as :func:`download_snapshot`; or the repo has no
            tokenizer file (``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer.model``,
            ``vocab.json``).
    """
    cache = hub_cache_dir(download_dir)
    where = f"{repo_id!r} (revision {revision or 'main'!r})"
    folder = _snapshot(repo_id, revision, cache, where, _METADATA_PATTERNS, _TOP_LEVEL_ONLY,
                       what="Tokenizer", token=token)
    if not any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
        raise ValueError(f"Hugging Face repo {where} has no tokenizer file (snapshot "
                         f"{folder!r}; looked for {', '.join(_TOKENIZER_FILES)})")
    return folder


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _snapshot(repo_id: str, revision: str | None, cache: str, where: str,
              allow: list[str], ignore: list[str], what: str = "Model",
              token: str | bool | None = None) -> str:
    """``huggingface_hub.snapshot_download`` of the files matching ``allow`` but not
    ``ignore``; its errors become one-line ValueErrors (see :func:`_download_error`)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                 allow_patterns=allow, ignore_patterns=ignore, token=token)
    except Exception as e:  # noqa: BLE001 - huggingface_hub/httpx/OS errors, each one line
        raise ValueError(_download_error(e, where, cache, what)) from None


def _weights_cached(folder: str, allow: list[str], ignore: list[str]) -> bool:
    """Whether the snapshot already holds the weights ``allow`` / ``ignore`` select: every
    file the safetensors index names, or (no index) a top-level ``*.safetensors``."""
    if allow != ["*.safetensors"]:
        return all(os.path.isfile(os.path.join(folder, name)) for name in allow)
    return any(name.endswith(".safetensors") and not name.startswith("consolidated")
               for name in os.listdir(folder))


def _weight_patterns(folder: str) -> tuple[list[str], list[str]]:
    """(allow, ignore) patterns of the weight files: those the safetensors index names, else
    the top-level ``*.safetensors`` but ``consolidated*`` (Mistral's own layout)."""
    index = os.path.join(folder, _INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        if files:
            return files, []
    return ["*.safetensors"], [*_TOP_LEVEL_ONLY, "consolidated*.safetensors"]


def _download_error(error: Exception, where: str, cache: str, what: str = "Model") -> str:
    """A one-line explanation of a huggingface_hub failure (``what``: the ``Model`` or the
    ``Tokenizer`` asked for)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE else \
            "the Hugging Face Hub could not be reached"
        return (f"{what} {where} is neither a local path, a packaged model, nor in the Hugging "
                f"Face cache {cache!r}, and {why}")
    if isinstance(error, RevisionNotFoundError):
        return f"Hugging Face repo {where}: no such revision (branch, tag or commit)"
    if isinstance(error, GatedRepoError):
        return f"Hugging Face repo {where} is gated: accept its terms and set HF_TOKEN"
    if isinstance(error, RepositoryNotFoundError):
        return (f"{what} {where} is neither a local path, a packaged model, nor a Hugging Face "
                "repo you can access (private repos need HF_TOKEN)")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"cannot download {where} from the Hugging Face Hub: {type(error).__name__}: " \
        f"{first_line}"


def _check_snapshot(folder: str, where: str, repo_id: str) -> None:
    """Raise ValueError unless the snapshot holds ``config.json`` and ``*.safetensors``; a
    repo without config.json that holds ``.gguf`` files (llama.cpp's format) is told to pass
    the file's path (see :func:`_gguf_hint`)."""
    names = os.listdir(folder)
    if "config.json" not in names:
        raise ValueError(f"Hugging Face repo {where} has no config.json (snapshot {folder!r}): "
                         f"not a transformers model{_gguf_hint(folder, repo_id)}")
    if not any(n.endswith(".safetensors") for n in names):
        raise ValueError(f"Hugging Face repo {where} has no *.safetensors weights (snapshot "
                         f"{folder!r}); kvflow loads safetensors, or a .gguf file given by "
                         "its path")


def _gguf_hint(folder: str, repo_id: str) -> str:
    """``"; it holds the GGUF file ...: pass its path"`` for the ``.gguf`` files of a repo
    (those in the cached snapshot, with their paths; else, when online, the names the Hub
    lists for the snapshot's commit, which kvflow does not download); ``""`` when none."""
    local = sorted(n for n in os.listdir(folder) if n.lower().endswith(".gguf"))
    if local:
        paths = ", ".join(repr(os.path.join(folder, n)) for n in local[:3])
        return f"; it holds GGUF file(s) {paths}: pass a .gguf file's path as the model"
    remote = _hub_gguf_names(repo_id, os.path.basename(folder))
    if remote:
        return (f"; it holds GGUF file(s) {', '.join(map(repr, remote[:3]))}: download one "
                "(huggingface-cli download) and pass its path as the model")
    return ""


def _hub_gguf_names(repo_id: str, commit: str) -> list[str]:
    """The ``.gguf`` file names the Hub lists for ``repo_id`` at ``commit`` (best effort: [] when
    offline, unreachable within 5 s, or on any Hub error)."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return []
    try:
        info = HfApi().model_info(repo_id, revision=commit, timeout=5)
    except Exception:  # noqa: BLE001 - only a hint: any failure means no hint
        return []
    return sorted(s.rfilename for s in info.siblings or [] if s.rfilename.lower().endswith(".gguf"))
