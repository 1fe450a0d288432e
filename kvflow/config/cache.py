"""The paged KV cache: block size, memory, prefix caching, swap space, KV dtype."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvflow.config.options import check_choices, opt, parse_bytes, parse_gib_or_bytes

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_SWAP_SPACE = "4GiB"


@dataclass
class CacheConfig:
    """The paged KV cache (``--block-size``, ``--kv-cache-memory``, ...).

    The pool's size comes from one setting: ``num_kv_blocks`` (blocks), ``kv_cache_memory``
    (bytes), or ``gpu_memory_utilization`` (a GPU's share of its memory, less weights and
    activations; 0.9 when none is set; a CPU's cache is 2 GiB instead). Unset fields are None,
    so "given" and "default" stay apart (``swap_space`` too: 4GiB when unset, and refused when
    given without swap preemption, ``EngineConfig``; ``enable_prefix_caching``: on where the
    engine can reuse prefixes when unset, refused as True where it cannot,
    ``kvflow.core.unread_options``).

    Raises:
        ValueError: from the constructor for a value out of range, or for two of the three
            size settings given together (one would go unread; ``_check_one_size``).
    """

    block_size: int = opt(16, "tokens per KV-cache block")
    kv_cache_memory: str | int | None = opt(
        None, "KV-cache size in bytes, e.g. 2GiB, or in vLLM's form (1G = 2**30, 1g = 10**9) "
        "(default: 2GiB on CPU; on a GPU what --gpu-memory-utilization leaves); "
        "--kv-cache-memory-bytes is vLLM's name for it",
        aliases=["--kv-cache-memory-bytes"])
    num_kv_blocks: int | None = opt(None, "KV-cache size in blocks (instead of a memory "
                                    "size: give one of --num-kv-blocks, --kv-cache-memory, "
                                    "--gpu-memory-utilization); --num-gpu-blocks-override is "
                                    "vLLM's name for it", aliases=["--num-gpu-blocks-override"])
    enable_prefix_caching: bool | None = opt(
        None, "reuse KV blocks of identical prompt prefixes (default: on, where the engine "
        "can: not for an encoder-only model, which keeps no KV cache, nor for an embedding "
        "model pooling more than its last token; asking for it there is refused)")
    prefix_caching_hash_algo: str = opt(
        "blake2b", "the prefix cache's block hash, also the hashes in KV cache events: "
        "blake2b (kvflow's own), sha256 (vLLM's: SHA-256 of the pickled (parent, tokens, "
        "extra keys)) or sha256_cbor (vLLM's over canonical CBOR, reproducible outside "
        "Python); vLLM's chain from a first-block seed, $PYTHONHASHSEED or 'vllm-none-hash'",
        choices=["blake2b", "sha256", "sha256_cbor"])
    gpu_memory_utilization: float | None = opt(
        None, "fraction of GPU memory kvflow may use (default: 0.9); refused on a platform "
        "whose KV cache has a fixed default size (CPU: --kv-cache-memory, 2GiB)")
    swap_space: str | float | None = opt(
        None, "host memory per worker for the KV blocks of swapped-out requests "
        "(--preemption-mode swap only; refused without it), e.g. 4GiB; a bare number is GiB, "
        f"as in vLLM (4 = 4GiB) (default: {DEFAULT_SWAP_SPACE})")
    kv_cache_dtype: str = opt("auto", "KV-cache element type: auto (the model dtype), int8 or "
                               "fp8_e4m3 (quantized per token and KV head with float32 scales "
                               "beside the blocks: about twice the blocks of a 16-bit cache "
                               "for the same --kv-cache-memory); fp8 is vLLM's name for "
                               "fp8_e4m3",
                               choices=["auto", "int8", "fp8", "fp8_e4m3"])

    def __post_init__(self) -> None:
        check_choices(self)
        if self.kv_cache_dtype == "fp8":  # vLLM's spelling: FP8 E4M3 (its CUDA default)
            self.kv_cache_dtype = "fp8_e4m3"
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 2")
        _check_size("kv_cache_memory", self.kv_cache_memory, parse_bytes)
        _check_size("swap_space", self.swap_space, parse_gib_or_bytes)
        if self.gpu_memory_utilization is not None \
                and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} "
                             "must be in (0, 1]")
        self._check_one_size()

    def _check_one_size(self) -> None:
        """Refuse two KV-cache size settings given together: the engine reads the first of
        ``num_kv_blocks``, ``kv_cache_memory``, ``gpu_memory_utilization`` that is set, so
        the other would be accepted and ignored (vLLM takes an explicit KV size over
        ``gpu_memory_utilization`` in silence).

        Raises:
            ValueError: naming both settings and their values.
        """
        given = [(name, getattr(self, name)) for name in
                 ("num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization")
                 if getattr(self, name) is not None]
        if len(given) > 1:
            (used, used_value), (unread, unread_value) = given[:2]
            raise ValueError(f"{used}={used_value!r} and {unread}={unread_value!r} both size "
                             "the KV cache, and only the first would be read; give one of "
                             "them")

    @property
    def swap_space_bytes(self) -> int:
        """``swap_space`` in bytes (a bare number is GiB, as vLLM reads it), or its default
        4GiB when unset."""
        return parse_gib_or_bytes(self.swap_space_or_default)

    @property
    def swap_space_or_default(self) -> str | float:
        """``swap_space`` as given, or its default ``"4GiB"`` when unset."""
        return DEFAULT_SWAP_SPACE if self.swap_space is None else self.swap_space

    @property
    def gpu_memory_fraction(self) -> float:
        """``gpu_memory_utilization``, or its default 0.9 when unset."""
        return DEFAULT_GPU_MEMORY_UTILIZATION if self.gpu_memory_utilization is None \
            else self.gpu_memory_utilization


def _check_size(name: str, value: str | float | None, parse: Callable[[Any], int]) -> None:
    """Raises ValueError naming field ``name`` (the CLI writes it as the flag typed) when
    ``parse`` refuses ``value``, a byte size (None: unset, not checked)."""
    if value is None:
        return
    try:
        parse(value)
    except ValueError as e:
        raise ValueError(f"{name}={value!r} is invalid: {e}") from None
