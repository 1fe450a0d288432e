"""Whether ``load_format="dummy"`` random weights fit, checked from config.json's sizes before
the model is built.

A real checkpoint's config is checked against its tensors' headers
(:mod:`kvflow.models.checkpoint_config_checks`); a dummy model has no tensors, so a config
with ``num_hidden_layers`` 100000 used to build layer after layer until the process was
killed for memory. Here a lower bound of the weights' bytes on this rank is computed from
the config alone and compared with the memory the device has left: host memory
(``MemAvailable``, capped by the memory cgroup's limit: :mod:`kvflow.platforms.memory_limits`)
on CPU, the GPU's free memory on CUDA.

The bound counts only tensors every supported architecture of that shape has, at their
smallest: the input embedding ``[vocab_size, hidden_size]`` (and the LM head when
``tie_word_embeddings`` is false), and per layer the attention projections (q, k, v, o:
``hidden_size x heads x head_dim``; with MLA's ``kv_lora_rank`` the output projection only)
and, for a model without routed experts, the MLP (gate, up and down of ``intermediate_size``
for a decoder, up and down for an encoder). Norms, biases, experts and vision towers are
left out, so a model the bound refuses cannot fit.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.distributed.parallel_state import ParallelState

_EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
_GiB = 2**30


def _int(config: Any, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def min_layer_params(config: Any, encoder: bool) -> int:
    """Parameters one layer of ``config`` (a text config) holds at least (see the module's
    docstring)."""
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    if _int(config, "kv_lora_rank"):  # MLA: o_proj [hidden, heads x v_head_dim]
        attention = hidden * heads * _int(config, "v_head_dim")
    else:
        head_dim = _int(config, "head_dim") or (hidden // heads if heads else 0)
        kv_heads = _int(config, "num_key_value_heads") or heads
        attention = 2 * hidden * head_dim * (heads + kv_heads)
    experts = any(_int(config, f) for f in _EXPERT_COUNT_FIELDS)
    mlp = 0 if experts else (2 if encoder else 3) * hidden * _int(config, "intermediate_size")
    return attention + mlp


def min_weight_bytes(hf_config: Any, dtype: torch.dtype, *, encoder: bool = False,
                     lm_head: bool = True, quantized: bool = False,
                     parallel: ParallelState | None = None) -> int:
    """A lower bound of the bytes of the weights this rank builds for ``hf_config``.

    Args:
        hf_config: the model's HF config (a composite one's text config is read).
        dtype: the weights' dtype (``--dtype``).
        encoder: an encoder-only model (two MLP projections, not three).
        lm_head: whether the model has an LM head (not a pooling model); counted when
            ``tie_word_embeddings`` is false (in the config and its text config alike).
        quantized: ``--quantization`` given: the layers' weights counted at 4 bits.
        parallel: this rank's groups: the layers are split over the pipeline stages (each
            has at least ``num_hidden_layers // pp`` of them) and the tensors over the
            tensor-parallel ranks; with several stages the embedding is not counted.

    Returns:
        Bytes (an int).
    """
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    tp = parallel.tp.world_size if parallel is not None else 1
    pp = parallel.pp.world_size if parallel is not None else 1
    layers = _int(config, "num_hidden_layers") // pp
    layer_bytes = min_layer_params(config, encoder) * (0.5 if quantized else dtype.itemsize)
    table = _int(config, "vocab_size") * _int(config, "hidden_size") * dtype.itemsize
    untied = all(getattr(c, "tie_word_embeddings", True) is False for c in (hf_config, config))
    tables = 0 if pp > 1 else table * (2 if lm_head and untied else 1)
    return int((layers * layer_bytes + tables) // tp)


def device_memory_available(device: torch.device) -> tuple[int, str] | None:
    """(free bytes, where that comes from) of ``device``: host memory on CPU
    (:func:`kvflow.platforms.memory_limits.host_memory_available`), the GPU's free memory on
    CUDA; None on another device (not checked)."""
    if device.type == "cpu":
        from kvflow.platforms.memory_limits import host_memory_available

        return host_memory_available()
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free memory of {device}"
    return None


def check_dummy_weights_fit(hf_config: Any, model_cls: type, dtype: torch.dtype,
                            device: torch.device, quantized: bool = False,
                            parallel: ParallelState | None = None,
                            available: tuple[int, str] | None = None) -> None:
    """Refuse ``load_format="dummy"`` weights that cannot fit before any is allocated.

    ``available``: (bytes, source) to compare with (None: :func:`device_memory_available`).

    Raises:
        ValueError: naming the config's sizes, the bytes the weights need at least and the
            memory available.
    """
    available = available or device_memory_available(device)
    if available is None:
        return
    need = min_weight_bytes(hf_config, dtype,
                            encoder=bool(getattr(model_cls, "is_encoder_only", False)),
                            lm_head=not getattr(model_cls, "is_pooling_only", False),
                            quantized=quantized, parallel=parallel)
    free, source = available
    if need <= free:
        return
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    sizes = ", ".join(f"{f}={getattr(config, f)}" for f in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
        if getattr(config, f, None) is not None)
    raise ValueError(f"load_format='dummy': the model config ({sizes}) needs at least "
                     f"{need / _GiB:.2f} GiB of {dtype} weights on this rank, more than "
                     f"the {free / _GiB:.2f} GiB available ({source})")
