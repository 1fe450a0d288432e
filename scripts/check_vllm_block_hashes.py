"""Check kvflow's vLLM-compatible block hashes against an installed vLLM's own functions.

Not a CI test (kvflow's environment has no vLLM): run it with a Python that has both vLLM
and kvflow importable, e.g.

    PYTHONPATH=. /work/vllm-venv/bin/python scripts/check_vllm_block_hashes.py

For ``sha256`` and ``sha256_cbor``, with ``PYTHONHASHSEED`` unset and set, it compares:
the first-block seed (vLLM's ``init_none_hash``), a 3-block request's hashes with a LoRA
adapter, a ``cache_salt`` and an image (vLLM's ``get_request_block_hasher`` on a vLLM
``Request`` against kvflow's ``KVCacheManager`` on a kvflow ``Request``), the 64-bit event
hashes (vLLM's ``maybe_convert_block_hash``) and the event extra keys
(``to_event_extra_keys``); and kvflow's canonical CBOR encoder against
``cbor2.dumps(canonical=True)``. Prints one line per check; exits 1 on a mismatch.
"""

from __future__ import annotations

import os
import sys

import cbor2
import torch
from vllm.lora.request import LoRARequest as VllmLoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as vku
from vllm.v1.request import Request as VllmRequest

from kvflow.core.block_hashing import BlockHasher, cbor_canonical, event_extra_keys
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_events import external_block_hash
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvflow.lora.request import LoRARequest
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BLOCK_SIZE = 4
PROMPT = [11, 24, 300, 70000, 15, 16, 255, 256, 19, 20, 65535, 65536, 23]  # 3 full blocks
IMAGE = ("img-0123abcd", 5, 4)  # identifier, offset, length: spans blocks 1 and 2
LORA = ("my-adapter", 7, "/adapters/my-adapter")
SALT = "tenant-a"
failures = 0


def check(what: str, ours: object, theirs: object) -> None:
    global failures
    ok = ours == theirs
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {what}" + ("" if ok else f": {ours!r} != {theirs!r}"))


def vllm_hashes(algo: str) -> tuple[list[bytes], list]:
    hash_fn = get_hash_fn_by_name(algo)
    vku.init_none_hash(hash_fn)
    mm = MultiModalFeatureSpec(data=None, modality="image", identifier=IMAGE[0],
                               mm_position=PlaceholderRange(offset=IMAGE[1], length=IMAGE[2]))
    req = VllmRequest("r", PROMPT, VllmSamplingParams(max_tokens=1), None,
                      mm_features=[mm], lora_request=VllmLoRARequest(LORA[0], LORA[1], LORA[2]),
                      cache_salt=SALT,
                      block_hasher=vku.get_request_block_hasher(BLOCK_SIZE, hash_fn))
    keys = [vku.generate_block_hash_extra_keys(req, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE, 0)[0]
            for i in range(len(req.block_hashes))]
    return list(req.block_hashes), vku.to_event_extra_keys(keys)


def kvflow_hashes(algo: str) -> tuple[list[int], list]:
    spec = FullAttentionSpec(BLOCK_SIZE, 1, 8, torch.float32)
    config = KVCacheConfig(16, (KVCacheGroupSpec(("layers.0.attn",), spec),))
    kv = KVCacheManager(config, True, hasher=BlockHasher(algo))
    image = MultiModalFeature("image", IMAGE[0], IMAGE[1], IMAGE[2], b"", (0, 0), (1, 1, 1))
    req = Request("r", PROMPT, SamplingParams(max_tokens=1), eos_token_id=None,
                  mm_features=[image], lora_request=LoRARequest(*LORA), cache_salt=SALT)
    kv.get_computed_blocks(req)
    keys = [event_extra_keys(req, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            for i in range(len(req.block_hashes))]
    return req.block_hashes, keys


def check_algo(algo: str, seed: str | None) -> None:
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    tag = f"{algo} PYTHONHASHSEED={seed}"
    theirs, their_keys = vllm_hashes(algo)
    check(f"{tag}: NONE_HASH", BlockHasher(algo).none_hash, bytes(vku.NONE_HASH))
    ours, our_keys = kvflow_hashes(algo)
    check(f"{tag}: 3 block hashes (LoRA, salt, image)",
          [h.to_bytes(32, "big") for h in ours], [bytes(h) for h in theirs])
    check(f"{tag}: event hashes", [external_block_hash(h) for h in ours],
          [vku.maybe_convert_block_hash(h) for h in theirs])
    check(f"{tag}: event extra_keys", our_keys, their_keys)


def main() -> int:
    samples = [None, True, False, 0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
               2**64 - 1, -1, -24, -25, -2**64, "", "vllm-none-hash", "é✓", b"", b"\x00" * 32,
               (), (b"\x01" * 32, tuple(range(30)), None),
               (b"\x02" * 32, (1, 2), (("lora", "a", "/p"), ("mm", "id", -3), ("cache_salt", "s")))]
    for obj in samples:
        check(f"canonical CBOR of {obj!r:.40}", cbor_canonical(obj), cbor2.dumps(obj, canonical=True))
    for algo in ("sha256", "sha256_cbor"):
        for seed in (None, "0", "1234"):
            check_algo(algo, seed)
    print(f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
