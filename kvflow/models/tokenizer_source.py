"""Where the tokenizer is loaded from when ``--tokenizer-revision`` names a Hub revision:
the Hub repo id of ``--tokenizer`` (else of the model) at that revision."""

from __future__ import annotations

import os

from kvflow.config.model import ModelConfig
from kvflow.models.hf_hub import parse_hub_name
from kvflow.models.model_resolver import find_packaged_model


def _hub_repo(name: str) -> tuple[str, str | None] | None:
    """``(repo id, revision or None)`` for a Hugging Face Hub repo id ``org/name[@revision]``
    that is no local path nor packaged model name (as ``resolve_model`` tells them apart);
    else None."""
    if os.path.exists(os.path.expanduser(name)) or find_packaged_model(name) is not None:
        return None
    return parse_hub_name(name)


def tokenizer_source(mc: ModelConfig) -> str | None:
    """What the tokenizer is loaded from (``load_tokenizer``'s ``tokenizer_path``):
    ``mc.tokenizer``, or with ``tokenizer_revision`` the Hub repo id (``tokenizer``'s, else the
    model's) at that revision, ``org/name@revision``; None: the model's own folder.

    Raises:
        ValueError: for a ``tokenizer_revision`` that cannot apply: ``tokenizer`` (else
            ``model``) is no Hub repo id (a local path or packaged model), or names another
            ``@revision``.
    """
    if mc.tokenizer_revision is None:
        return mc.tokenizer
    hub = _hub_repo(mc.tokenizer or mc.model)
    name = "tokenizer" if mc.tokenizer else "model"
    if hub is None:
        raise ValueError(f"tokenizer_revision={mc.tokenizer_revision!r} applies to Hugging "
                         f"Face repo ids only, and {name} {mc.tokenizer or mc.model!r} is a "
                         "local path, a packaged model, or no repo id")
    if mc.tokenizer and hub[1] not in (None, mc.tokenizer_revision):
        raise ValueError(f"tokenizer {mc.tokenizer!r} names revision {hub[1]!r} but "
                         f"tokenizer_revision={mc.tokenizer_revision!r} was given; give one")
    return f"{hub[0]}@{mc.tokenizer_revision}"
