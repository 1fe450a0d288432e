"""Reading a PEFT LoRA folder and checking it against the model it will run on.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ``rank_pattern`` / ``alpha_pattern``, ...) and ``adapter_model.safetensors``
with, per adapted linear layer, ``<module>.lora_A.weight`` ``[r, in]`` and
``<module>.lora_B.weight`` ``[out, r]`` (names prefixed ``base_model.model.``). The layer then
computes ``y = x W^T + scaling * (x A^T) B^T`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` under rsLoRA; Hu et al. 2021, eq. 3; Kalajdzievski 2023).

kvflow fuses q/k/v and gate/up into one matmul each; the model's ``packed_modules_mapping``
says where a PEFT module lands (``q_proj`` -> shard ``"q"`` of ``qkv_proj``). Everything kvflow
cannot apply (DoRA, trained biases, ``modules_to_save``, activated LoRA, replicated layers,
embedding or LM-head targets, a rank
above ``max_lora_rank``, a module the model does not have, a shape that does not fit, weights
whose rank is not the config's, weights of a module the config's ``target_modules`` (unset:
peft's default for the model type) / ``layers_to_transform`` / ``exclude_modules`` leave out)
is a ``ValueError`` when the adapter is loaded, never at a request.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.lora.adapter_config import (
    check_adapter_config,
    lora_scaling,
    pattern_value,
    rank_error,
    read_adapter_config,
)
from kvflow.lora.adapter_targets import (
    check_weights_in_config,
    weightless_targets,
)
from kvflow.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_PREFIX = "base_model.model."
_WEIGHT_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>[AB])(\.default)?\.weight$")


@dataclass(frozen=True)
class LoRATarget:
    """A linear layer of the model that LoRA can adapt.

    Attributes:
        input_size: its input features.
        shard_sizes: output rows of each fused checkpoint shard, by shard id (``{None: out}``
            for an unfused layer).
    """

    input_size: int
    shard_sizes: dict[Any, int]


@dataclass
class LoRAAdapter:
    """One loaded adapter: per kvflow module, per shard, ``(A [r, in], B [out, r])`` with the
    scaling already folded into ``B`` (model dtype, host memory).

    Attributes:
        request: the LoRARequest it was loaded for.
        rank: its largest rank.
        weights: kvflow module name -> shard id -> (A, B).
    """

    request: LoRARequest
    rank: int
    weights: dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor]]]


def _check_config_rank(config: dict[str, Any], peft_module: str, rank: int,
                       path: str) -> None:
    """Raises ValueError when the weights' ``rank`` of ``peft_module`` is not the rank
    ``adapter_config.json`` gives it (``rank_pattern``, else ``r``): the scaling
    ``lora_alpha / r`` would be ambiguous, and peft refuses to load such an adapter."""
    module = peft_module.removeprefix(_PREFIX)
    said = pattern_value(config.get("rank_pattern"), module, config.get("r", 8))
    if said != rank:
        raise ValueError(f"adapter module {peft_module!r} of {path!r} has rank {rank} "
                         f"(lora_A rows) but adapter_config.json says {said}: the config "
                         "does not belong to these weights")


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of the folder's ``adapter_model.safetensors``.

    Raises:
        ValueError: naming the file when it is missing, truncated or corrupt.
    """
    from kvflow.models.safetensors_files import iter_safetensors_file

    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors")
    return dict(iter_safetensors_file(weights_path, "LoRA adapter file"))


def _kvflow_module(peft_module: str, packed: dict[str, tuple[str, Any]],
                   rename: Callable[[str], str] | None = None) -> tuple[str, Any]:
    """A PEFT module name -> (kvflow module name, shard id): the model's checkpoint renames
    (``rename``), then ``packed_modules_mapping``."""
    name = peft_module.removeprefix(_PREFIX)
    if rename is not None:
        name = rename(name)
    head, _, leaf = name.rpartition(".")
    if leaf in packed:
        fused, shard = packed[leaf]
        return f"{head}.{fused}" if head else fused, shard
    return name, None


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget],
                 packed: dict[str, tuple[str, Any]], max_rank: int,
                 dtype: torch.dtype, rename: Callable[[str], str] | None = None,
                 model_type: str | None = None,
                 elsewhere: Callable[[str], bool] | None = None,
                 towers: tuple[str, ...] = ()) -> LoRAAdapter:
    """Read and check a PEFT folder against the model's LoRA targets. Modules the config
    adapts that hold no weights (peft loads zero deltas there and warns) are logged, one
    warning per load.

    Args:
        request: the adapter's name, id and folder.
        targets: kvflow module name -> its sizes (the layers this model can adapt).
        packed: the model's ``packed_modules_mapping`` (PEFT name -> fused layer, shard).
        max_rank: ``--max-lora-rank``.
        dtype: the model dtype (the weights are cast to it).
        rename: the model's checkpoint-name mapping (``checkpoint_name``; Qwen2-VL's
            ``model.language_model.*`` -> ``model.*``), None for none.
        model_type: the base model's config.json ``model_type``: a config without
            ``target_modules`` adapts what peft adapts by default for it.
        elsewhere: kvflow module name -> whether another pipeline stage holds it (its
            weights are left to that stage, which checks them; None: one stage). A stage
            may then keep no weights of an adapter.
        towers: name prefixes (``"vision_tower."``) of a multimodal model's parts that
            kvflow does not adapt (its vision tower, projector): a module there is refused
            saying so.

    Raises:
        ValueError: for anything kvflow cannot apply (see ``check_adapter_config``), a
            truncated or corrupt ``adapter_model.safetensors`` (naming it), a target module the
            model does not have (or cannot adapt; in ``towers``: naming the part), an A without its B, a shape that does not
            fit the layer, a weight that is not floating point or not finite, weights
            of a module that ``target_modules`` (unset: peft's default for ``model_type``) /
            ``layers_to_transform`` / ``exclude_modules`` leave out (peft would drop them;
            naming the field), or no ``target_modules`` for a model type peft has no
            default for.
    """
    config = _read_checked_config(request, max_rank)
    pairs = _weight_pairs(_read_tensors(request.lora_path), request.lora_path)
    peft_modules = [m.removeprefix(_PREFIX) for m in sorted(pairs)]
    check_weights_in_config(config, peft_modules, request.lora_path, model_type)
    _warn_weightless_targets(request, config, model_type, targets, packed, peft_modules,
                             rename)
    weights: dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for peft_module, ab in sorted(pairs.items()):
        module, shard = _kvflow_module(peft_module, packed, rename)
        if elsewhere is not None and elsewhere(module):
            continue
        a, b = _checked_pair(peft_module, module, shard, ab, targets, towers)
        _check_weights_rank(request, config, peft_module, a.shape[0], max_rank)
        weights.setdefault(module, {})[shard] = _folded_pair(config, peft_module, a, b, dtype)
        rank = max(rank, a.shape[0])
    if not pairs:
        raise ValueError(f"LoRA adapter {request.lora_path!r} holds no LoRA weights")
    return LoRAAdapter(request, rank, weights)


def _read_checked_config(request: LoRARequest, max_rank: int) -> dict[str, Any]:
    """The folder's ``adapter_config.json``, read and refused where kvflow cannot apply it.

    Raises:
        ValueError: see :func:`read_adapter_config` and :func:`check_adapter_config`.
    """
    config = read_adapter_config(request.lora_path)
    check_adapter_config(config, max_rank,
                         repr(os.path.join(request.lora_path, "adapter_config.json")),
                         request.lora_name)
    return config


def _weight_pairs(tensors: dict[str, torch.Tensor],
                  path: str) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter's tensors grouped by PEFT module: module -> ``{"A": A, "B": B}`` (either may
    be missing; :func:`_checked_pair` refuses that), each tensor's values checked.

    Raises:
        ValueError: naming a tensor that is not a LoRA A/B weight of a linear layer, or whose
            values are not finite floating point (see :func:`_check_values`).
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_RE.match(key)
        if match is None:
            raise ValueError(f"adapter tensor {key!r} cannot be applied: kvflow loads LoRA A/B "
                             "weights of linear layers only (no saved whole modules, "
                             "embeddings or LM head)")
        _check_values(key, tensor, path)
        pairs.setdefault(match["module"], {})[match["kind"]] = tensor
    return pairs


def _warn_weightless_targets(request: LoRARequest, config: dict[str, Any],
                             model_type: str | None, targets: dict[str, LoRATarget],
                             packed: dict[str, tuple[str, Any]], peft_modules: list[str],
                             rename: Callable[[str], str] | None) -> None:
    """Log one warning when the config adapts modules that hold no weights (peft loads zero
    deltas there)."""
    unweighted = weightless_targets(config, model_type, _unfused_modules(targets, packed),
                                    [rename(m) if rename else m for m in peft_modules],
                                    rename is not None)
    if unweighted is not None:
        logger.warning("LoRA adapter %r (%s): %s", request.lora_name, request.lora_path,
                       unweighted)


def _check_weights_rank(request: LoRARequest, config: dict[str, Any], peft_module: str,
                        rank: int, max_rank: int) -> None:
    """The rank of ``peft_module``'s weights (lora_A rows) must be at most ``max_rank`` and
    the one its ``adapter_config.json`` gives it.

    Raises:
        ValueError: see :func:`rank_error` and :func:`_check_config_rank`.
    """
    if rank > max_rank:  # its weights say more than its adapter_config.json
        raise rank_error(request.lora_name, rank, max_rank,
                         f"module {peft_module!r} of {request.lora_path!r}")
    _check_config_rank(config, peft_module, rank, request.lora_path)


def _folded_pair(config: dict[str, Any], peft_module: str, a: torch.Tensor, b: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [r, in], B [out, r])`` cast to ``dtype`` with the module's scaling
    (``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA) folded into B in float32 first."""
    scale = lora_scaling(config, peft_module.removeprefix(_PREFIX), a.shape[0])
    return a.to(dtype), (b.float() * scale).to(dtype)


def _unfused_modules(targets: dict[str, LoRATarget],
                     packed: dict[str, tuple[str, Any]]) -> list[str]:
    """The modules a PEFT adapter can name, in kvflow's names: each target, a fused one as
    its parts (``qkv_proj`` shard ``"q"`` -> ``q_proj``, by ``packed_modules_mapping``)."""
    part = {(fused, shard): leaf for leaf, (fused, shard) in packed.items()}
    out = []
    for name, target in targets.items():
        head, _, leaf = name.rpartition(".")
        for shard in target.shard_sizes:
            unfused = leaf if shard is None else part.get((leaf, shard))
            if unfused is not None:
                out.append(f"{head}.{unfused}" if head else unfused)
    return out


def _check_values(key: str, tensor: torch.Tensor, path: str) -> None:
    """A LoRA weight must hold finite floating-point values: an integer tensor would be cast
    to whole-number weights (peft refuses to load one), a NaN or infinity makes every adapted
    token's logits NaN (the request then ends after one arbitrary token).

    Raises:
        ValueError: naming the tensor, the folder and the problem.
    """
    if not tensor.is_floating_point():
        raise ValueError(f"adapter tensor {key!r} of {path!r} has dtype {tensor.dtype}; LoRA "
                         "weights must be floating point")
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"adapter tensor {key!r} of {path!r} holds NaN or infinite values "
                         "(a diverged or corrupt training run?)")


def _checked_pair(peft_module: str, module: str, shard: Any, ab: dict[str, torch.Tensor],
                  targets: dict[str, LoRATarget], towers: tuple[str, ...] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one adapted module, checked against the layer it lands in.

    Raises:
        ValueError: see :func:`load_adapter`.
    """
    target = targets.get(module)
    tower = next((t for t in towers if module.startswith(t)), None)
    if target is None and tower is not None:
        raise ValueError(f"LoRA target module {peft_module!r} is in the model's "
                         f"{tower.rstrip('.')!r} (the vision tower or its projector): kvflow "
                         "applies LoRA adapters to the language model only; train the adapter "
                         "with target_modules limited to it (e.g. the regex "
                         r"'.*language_model.*\.(q_proj|v_proj)')")
    if target is None and module.rpartition(".")[2] in {t.rpartition(".")[2] for t in targets}:
        raise ValueError(f"LoRA target module {peft_module!r} cannot be applied: this model "
                         f"has no module {module!r} (an adapter for another base model?)")
    if target is None or shard not in target.shard_sizes:
        names = sorted({t.rpartition(".")[2] for t in targets})
        raise ValueError(f"LoRA target module {peft_module!r} cannot be applied: kvflow adapts "
                         f"only the linear layers {names} of this model (and their q/k/v, "
                         "gate/up parts)")
    if set(ab) != {"A", "B"}:
        raise ValueError(f"adapter module {peft_module!r} lacks its lora_A or lora_B weight")
    a, b = ab["A"], ab["B"]
    out = target.shard_sizes[shard]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.input_size or \
            tuple(b.shape) != (out, rank):
        raise ValueError(f"adapter module {peft_module!r} has lora_A {tuple(a.shape)} and "
                         f"lora_B {tuple(b.shape)}; the layer needs [r, {target.input_size}] "
                         f"and [{out}, r] (an adapter for another base model?)")
    return a, b
