"""Counter-based noise for seeded requests: the numbers a seeded request samples its output
token ``p`` with are a pure function of ``(seed, p)``.

A seeded request's token ``p`` (0-based among its generated tokens) is the exponential race
``argmax(probs / E)`` (the Gumbel-max trick in product form: with ``E`` i.i.d. Exp(1), index
``x`` wins with probability ``probs[x] / sum(probs)``), where ``probs`` is the distribution
plain sampling draws from (after logit bias, penalties, bans, the grammar's mask,
temperature, top-k / top-p / min-p) and ``E`` is the vector :func:`fill_exponential` draws for
``(seed, p)``. Nothing else the engine does (the batch, drafts verified or cut, preemption,
adaptive draft lengths) consumes those numbers, so the token depends on the prompt, the
parameters and the seed only, and speculative decoding can verify a seeded request's drafts
exactly: a draft is accepted iff it equals the token plain sampling would draw at its position
(``spec_decode/rejection_sampler.py``).

Construction: ``E`` is drawn by ``torch.Generator.exponential_`` from a generator seeded with
``position_seed(seed, p)``, the ``p``-th output of SplitMix64 seeded with ``seed`` (Steele, Lea
and Flood 2014, "Fast Splittable Pseudorandom Number Generators", OOPSLA; the finalizer of
``java.util.SplittableRandom``): distinct positions get unrelated 64-bit seeds, so the
vectors of different positions are independent draws of torch's generator (Philox on CUDA,
MT19937 on CPU, which keeps the low 32 bits of a seed: two positions share a vector with
probability 2**-32). The numbers differ between device types, as torch's generators do.
"""

from __future__ import annotations

import torch

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment, 2**64 / golden ratio, odd
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The ``position``-th (0-based) output of SplitMix64 seeded with ``seed`` (any integer,
    taken modulo 2**64): an unsigned 64-bit integer in [0, 2**64).

    Raises:
        ValueError: for a negative ``position``.
    """
    if position < 0:
        raise ValueError(f"position={position} must be >= 0 (an output token's index)")
    z = (seed + (position + 1) * _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def fill_exponential(out: torch.Tensor, seed: int, position: int) -> torch.Tensor:
    """Fill ``out`` (a contiguous float32 [V] vector: one row of the vocabulary, on any
    device) in place with the Exp(1) draws of ``seed``'s output position ``position``
    (module docstring), and return it. The same ``(seed, position)``, length, dtype and
    device type give the same numbers, whatever else is drawn.

    Raises:
        ValueError: for a negative ``position``.
    """
    gen = torch.Generator(device=out.device)
    gen.manual_seed(position_seed(seed, position))
    return out.exponential_(generator=gen)


def seeded_exponentials(seed: int, position: int, count: int, vocab_size: int,
                        device: torch.device) -> torch.Tensor:
    """float32 [count, vocab_size]: row ``j`` holds ``fill_exponential``'s draws of output
    position ``position + j`` of ``seed``.

    Raises:
        ValueError: for a negative ``position``.
    """
    out = torch.empty((count, vocab_size), dtype=torch.float32, device=device)
    for j in range(count):
        fill_exponential(out[j], seed, position + j)
    return out
