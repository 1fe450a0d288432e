"""The API key a server takes from the environment when ``--api-key`` is not given: vLLM's
``VLLM_API_KEY`` (vllm/envs.py, read by vLLM's server as the key when no ``--api-key`` is
given) or kvflow's own ``KVFLOW_API_KEY``. A deployment that keeps its key in
``VLLM_API_KEY`` (a Kubernetes secret written for vLLM) was served by kvflow with no key at
all: every route open, without a word."""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY_VARIABLES = ("KVFLOW_API_KEY", "VLLM_API_KEY")


def api_key_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The key set in ``env`` (default: the process environment) by either variable of
    :data:`API_KEY_VARIABLES`; None when neither is set.

    Raises:
        ValueError: naming the variable, for one set but empty or blank (an empty key would
            leave the server open, where the setting meant to close it; vLLM reads an empty
            ``VLLM_API_KEY`` as no key: unset it to serve without one), or when both are set
            to different keys (naming both, not their values).
    """
    env = os.environ if env is None else env
    given: dict[str, str] = {}
    for name in API_KEY_VARIABLES:
        key = env.get(name)
        if key is None:
            continue
        if not key.strip():
            raise ValueError(f"{name}={key!r} is empty: an empty key would leave the server "
                             "open; give a key, or unset the variable to serve without one")
        given[name] = key
    if len(set(given.values())) > 1:
        raise ValueError(f"{' and '.join(given)} are set to different keys; set one of them "
                         "(or both alike), or give --api-key")
    return next(iter(given.values()), None)
