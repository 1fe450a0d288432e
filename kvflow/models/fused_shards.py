"""Which parts of a fused parameter a checkpoint filled.

kvflow fuses checkpoint tensors into one parameter (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``: ``packed_modules_mapping``). The loader counts a parameter as loaded once any
tensor reached it, so a checkpoint that lacks one part (``k_proj.weight`` but not ``q_proj`` or
``v_proj``) would leave that part's rows as the uninitialized memory they were allocated with.
:func:`note_loaded_shard` records each part as it loads (on the parameter, as
``weight_loader`` is); :func:`missing_shard_tensors` names the checkpoint tensors of the parts
still missing, and forgets the records. MoE experts stacked into ``w13_weight`` / ``w2_weight``
are checked the same way (:func:`note_loaded_expert`, :func:`missing_expert_tensors`): a
checkpoint of one tensor per expert may lack one expert's gate, up or down projection.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_RECORD = "kvflow_loaded_shards"  # parameter attribute: the set of shards loaded so far
_EXPERTS = "kvflow_loaded_experts"  # parameter attribute: {(shard_id, expert_id): name}
# the per-expert parts each stacked expert parameter needs, and the stacked tensor covering them
_EXPERT_PARTS = {"w13_weight": (("w1", "w3"), "w13"), "w2_weight": (("w2",), "w2")}


def note_loaded_shard(param: nn.Parameter, shard: Any) -> None:
    """Record that ``shard`` of ``param`` (``"q"``, ``0``, ...) was loaded; ``shard`` None: a
    tensor filled the whole parameter (an unfused one, or a checkpoint that stores the fused
    tensor), which needs no record (and drops any)."""
    if shard is None:
        if hasattr(param, _RECORD):
            delattr(param, _RECORD)
        return
    setattr(param, _RECORD, {*getattr(param, _RECORD, set()), shard})


def missing_shard_tensors(model: nn.Module, packed_modules_mapping: dict[str, tuple[str, Any]]
                          ) -> list[str]:
    """Checkpoint names of the fused-parameter parts no tensor filled, sorted.

    Args:
        model: the model after ``load_weights``; each fused layer (``shard_ids`` of more than
            one part) whose parameters :func:`note_loaded_shard` saw is checked, and the
            records are removed.
        packed_modules_mapping: the model's checkpoint module -> (fused module, shard) map,
            used to name a missing part as the checkpoint would (``k_proj`` for shard ``"k"`` of
            ``qkv_proj``).

    Returns:
        e.g. ``["model.layers.0.self_attn.k_proj.weight"]``; empty when nothing is missing.
    """
    names = {(dst, shard): src for src, (dst, shard) in packed_modules_mapping.items()}
    missing: list[str] = []
    for prefix, module in model.named_modules():
        shard_ids = getattr(module, "shard_ids", (None,))
        if len(shard_ids) < 2:
            continue
        fused = prefix.rsplit(".", 1)[-1]
        for pname, param in module.named_parameters(recurse=False):
            if not hasattr(param, _RECORD):
                continue
            seen = getattr(param, _RECORD)
            delattr(param, _RECORD)
            for shard in shard_ids:
                if shard not in seen:
                    part = names.get((fused, shard), f"{fused}[{shard}]")
                    missing.append(f"{prefix.rsplit('.', 1)[0]}.{part}.{pname}")
    return sorted(missing)


def note_loaded_expert(param: nn.Parameter, shard_id: str, expert_id: int | None,
                       name: str) -> None:
    """Record that checkpoint tensor ``name`` filled part ``shard_id`` (``"w1"``, ``"w3"``,
    ``"w2"``, ``"w13"``) of expert ``expert_id`` (None: every expert, a stacked tensor) of an
    MoE layer's ``param`` (``w13_weight`` or ``w2_weight``); every rank records every expert,
    also those another expert-parallel rank holds."""
    records = getattr(param, _EXPERTS, None)
    if records is None:
        records = {}
        setattr(param, _EXPERTS, records)
    records[(shard_id, expert_id)] = name


def missing_expert_tensors(model: nn.Module) -> list[str]:
    """Checkpoint names of the expert parts no tensor filled (per-expert checkpoints), sorted;
    the records :func:`note_loaded_expert` left are removed. A part is named after a tensor of
    the same part of another expert (``...experts.1.w2.weight`` beside ``...experts.0.w2.weight``).
    """
    missing: list[str] = []
    for prefix, module in model.named_modules():
        num_experts = getattr(module, "num_experts", None)
        for pname, (parts, stacked) in _EXPERT_PARTS.items():
            param = getattr(module, pname, None)
            records = getattr(param, _EXPERTS, None) if num_experts else None
            if records is None:
                continue
            delattr(param, _EXPERTS)
            if (stacked, None) in records:
                continue
            for expert in range(num_experts):
                if (stacked, expert) in records:
                    continue
                for part in parts:
                    if (part, expert) not in records:
                        missing.append(_expert_name(records, part, expert, prefix))
    return sorted(missing)


def _expert_name(records: dict[tuple[str, int | None], str], part: str, expert: int,
                 prefix: str) -> str:
    """Expert ``expert``'s checkpoint name for ``part``, after another expert's."""
    for (shard, other), name in records.items():
        if shard == part and other is not None:
            return name.replace(f".experts.{other}.", f".experts.{expert}.", 1)
    return f"{prefix}.{expert}.{part}.weight"
