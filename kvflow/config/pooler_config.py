"""``--pooler-config`` (vLLM 0.32's flag; ``LLM(pooler_config=...)``): a JSON object of vLLM's
``PoolerConfig`` fields that override what the model folder says about its pooling.

Taken, as vLLM 0.32 reads them (a field given wins over the model's sentence-transformers
files, an unset or null one leaves the model's value):

- ``pooling_type`` / ``seq_pooling_type``: "CLS", "MEAN" or "LAST" (the pooled token(s) of
  embed, score and classify); ``pooling_type`` "ALL" / ``tok_pooling_type`` "ALL" name the
  per-token tasks' pooling, which is the only one kvflow runs (accepted, no change).
- ``use_activation``: the default of a request's ``use_activation``: an embedding's L2
  normalization, a score / classify head's activation (a request's own value wins).
- ``dimensions``: the default Matryoshka ``dimensions`` of embed / token_embed requests.
- ``logit_mean`` / ``logit_sigma``: affine calibration of a classification head's logits
  before the activation, ``activation((logit - logit_mean) / logit_sigma)``.
- ``enable_flash_late_interaction``: vLLM's kernel choice for late-interaction scoring,
  which kvflow has no kernel or model for: accepted, no effect.

Refused, naming the field: what kvflow does not run (``tok_pooling_type`` "STEP",
``step_tag_id`` / ``returned_token_ids``: vLLM's step reward models; ``enable_chunked_processing``
true and ``max_embed_len``: embedding inputs longer than the context), ``task`` (the engine's
task is ``--task`` / ``--runner pooling --convert ...``), vLLM's removed ``normalize`` (as
vLLM 0.32 refuses it) and any other key.
"""

from __future__ import annotations

import json
from typing import Any

from kvflow.config.options import json_config_dict

FLAG = "--pooler-config (pooler_config)"
FIELDS = ("task", "pooling_type", "seq_pooling_type", "tok_pooling_type", "use_activation",
          "enable_flash_late_interaction", "dimensions", "enable_chunked_processing",
          "max_embed_len", "logit_mean", "logit_sigma", "step_tag_id", "returned_token_ids")
SEQ_TYPES = {"CLS": "cls", "MEAN": "mean", "LAST": "last"}
_TOK_TYPES = ("ALL", "STEP")
# set to anything but these, the field asks for what kvflow does not run
_STEP = "step pooling (vLLM's process reward models) is not supported"
_UNSUPPORTED = {
    "task": (None, ("the engine's pooling task is chosen with --task (task=) or vLLM's "
                    "--runner pooling --convert embed|classify")),
    "enable_chunked_processing": (False, ("kvflow embeds an input of at most max_model_len "
                                          "tokens, it does not split longer ones into "
                                          "chunks")),
    "max_embed_len": (None, "kvflow embeds an input of at most max_model_len tokens"),
    "step_tag_id": (None, _STEP),
    "returned_token_ids": (None, _STEP),
}


def parse_pooler_config(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """``--pooler-config`` as a checked dict of the fields set (nulls dropped), None for
    none (None, ``null``, ``{}``).

    Raises:
        ValueError: naming the flag, for text that is not a JSON object, an unknown key (all
            of them named, with vLLM's fields), ``normalize`` (removed in vLLM 0.32: use
            ``use_activation``), a field kvflow does not run (see the module docstring), or a
            value of the wrong type or range.
    """
    if value is not None:
        value = json_config_dict(FLAG, value, '{"pooling_type": "CLS"}')
    if value is None:
        return None
    if "normalize" in value:
        raise ValueError(f"{FLAG}: normalize was removed in vLLM 0.32; use use_activation "
                         "(an embedding's L2 normalization)")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ValueError(f"{FLAG}: unknown keys {unknown}; vLLM's PoolerConfig fields are "
                         f"{list(FIELDS)}")
    given = {k: v for k, v in value.items() if v is not None}
    for name, (default, why) in _UNSUPPORTED.items():
        if name in given and given[name] != default:
            raise ValueError(f"{FLAG}: {name}={json.dumps(given[name])} is not supported: "
                             f"{why}")
    _check_types(given)
    return given or None


def _check_types(given: dict[str, Any]) -> None:
    """Raises ValueError naming the field for a value of the wrong type or range."""
    def fail(name: str, want: str) -> ValueError:
        return ValueError(f"{FLAG}: {name}={json.dumps(given[name])} must be {want}")

    types = {"pooling_type": (*SEQ_TYPES, *_TOK_TYPES), "seq_pooling_type": tuple(SEQ_TYPES),
             "tok_pooling_type": _TOK_TYPES}
    for name, allowed in types.items():
        if name in given and given[name] not in allowed:
            raise fail(name, f"one of {list(allowed)}")
    if "pooling_type" in given and ({"seq_pooling_type", "tok_pooling_type"} & set(given)):
        raise ValueError(f"{FLAG}: pooling_type with seq_pooling_type or tok_pooling_type: "
                         "set one (vLLM refuses both)")
    if "STEP" in (given.get("pooling_type"), given.get("tok_pooling_type")):
        raise ValueError(f"{FLAG}: STEP pooling (vLLM's process reward models) is not "
                         "supported; kvflow's per-token tasks pool ALL tokens")
    for name in ("use_activation", "enable_flash_late_interaction"):
        if name in given and not isinstance(given[name], bool):
            raise fail(name, "true or false")
    d = given.get("dimensions")
    if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
        raise fail("dimensions", "an integer >= 1")
    for name in ("logit_mean", "logit_sigma"):
        v = given.get(name)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise fail(name, "a number")
    if given.get("logit_sigma") == 0:
        raise fail("logit_sigma", "non-zero (the logits are divided by it)")
