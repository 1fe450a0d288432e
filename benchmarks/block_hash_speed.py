"""Host time of one prefix-cache block hash per ``--prefix-caching-hash-algo``: chain-hash
``--blocks`` blocks of ``--block-size`` token ids (ids from 1000 up: 2-byte CBOR heads), no
extra keys, best of ``--repeats`` passes. A request's blocks are hashed once (the hashes stay
on the request), so this is a per-prompt cost: blocks x time per block.

    PYTHONPATH=. .venv/bin/python benchmarks/block_hash_speed.py
"""

from __future__ import annotations

import argparse
import time

from kvflow.core.block_hashing import PREFIX_CACHING_HASH_ALGOS, BlockHasher


def time_per_block(algo: str, blocks: list[tuple[int, ...]], repeats: int) -> float:
    """Best-of-``repeats`` seconds per block for one algorithm."""
    hasher, best = BlockHasher(algo), float("inf")
    for _ in range(repeats):
        start, parent = time.perf_counter(), None
        for block in blocks:
            parent = hasher.hash_block(parent, block, None)
        best = min(best, time.perf_counter() - start)
    return best / len(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    bs = args.block_size
    blocks = [tuple(range(1000 + bs * i, 1000 + bs * (i + 1))) for i in range(args.blocks)]
    for algo in PREFIX_CACHING_HASH_ALGOS:
        print(f"{algo}: {time_per_block(algo, blocks, args.repeats) * 1e6:.2f} us/block")


if __name__ == "__main__":
    main()
