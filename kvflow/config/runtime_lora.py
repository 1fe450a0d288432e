"""Whether the server loads and unloads LoRA adapters at run time, read from the environment
as vLLM reads ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (vllm/envs.py): off unless set to ``1`` or
``true``. On, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served, and
any client holding the API key can make the server read adapter files from any path it can
read; off, both routes answer 404. ``KVFLOW_ALLOW_RUNTIME_LORA_UPDATING`` is the same switch
under kvflow's own prefix (as ``KVFLOW_SERVER_DEV_MODE`` is vLLM's ``VLLM_SERVER_DEV_MODE``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

RUNTIME_LORA_VARIABLES = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                          "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING")
_ON = ("1", "true")
_OFF = ("0", "false", "")


def runtime_lora_updating(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default: the process environment) turns runtime LoRA updating on:
    either variable of :data:`RUNTIME_LORA_VARIABLES` set to ``1`` or ``true`` (any case,
    blanks around ignored, as vLLM reads it); unset, empty, ``0`` or ``false``: off.

    Raises:
        ValueError: for another value (naming the variable: vLLM would take a misspelt
            ``yes`` as off without a word), or when the two variables disagree.
    """
    env = os.environ if env is None else env
    given: dict[str, bool] = {}
    for name in RUNTIME_LORA_VARIABLES:
        value = env.get(name)
        if value is None:
            continue
        word = value.strip().lower()
        if word not in _ON + _OFF:
            raise ValueError(f"{name}={value!r} is invalid; choose 1 or true (serve "
                             "/v1/load_lora_adapter and /v1/unload_lora_adapter) or 0 or false")
        given[name] = word in _ON
    if len(set(given.values())) > 1:
        settings = " and ".join(f"{name}={env[name]!r}" for name in given)
        raise ValueError(f"{settings} disagree; set one of them (or both alike)")
    return any(given.values())
