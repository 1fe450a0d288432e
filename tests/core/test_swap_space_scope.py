"""``--swap-space`` sizes the host pool of ``--preemption-mode swap``; with ``recompute`` (the
default) there is no pool, so a size other than the default is refused, naming both flags,
instead of being ignored. A bare number is GiB, as vLLM reads it, so a vLLM command line's
``--swap-space 4`` is the default and passes."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig


@pytest.mark.parametrize("swap_space", ["1MiB", "8GiB", 8, "8", 0.5])
def test_a_pool_size_without_swap_preemption_is_refused(swap_space):
    with pytest.raises(ValueError, match=rf"^--swap-space {swap_space} \(swap_space\) sizes the "
                                         r"host pool of --preemption-mode swap, and this engine "
                                         r"preempts by recompute, which keeps none: add "
                                         r"--preemption-mode swap .*, or leave --swap-space out$"):
        EngineConfig.from_kwargs(swap_space=swap_space)


# the default's size: 4GiB, and vLLM's default written its way (a bare number of GiB)
@pytest.mark.parametrize("swap_space", ["4GiB", "4 GiB", "4096MiB", 4, "4", 4.0, " 4.0 "])
def test_the_default_size_passes_with_recompute(swap_space):
    assert EngineConfig.from_kwargs(swap_space=swap_space).cache_config.swap_space == swap_space


def test_swap_preemption_takes_any_size():
    config = EngineConfig.from_kwargs(swap_space="1MiB", preemption_mode="swap")
    assert config.cache_config.swap_space == "1MiB"


@pytest.mark.parametrize(("swap_space", "expected"), [
    (8, 8 * 2**30), ("8", 8 * 2**30), (0.5, 2**29), (".25", 2**28),  # GiB, as vLLM
    ("8GiB", 8 * 2**30), ("512MiB", 2**29), ("1GB", 10**9), ("1048576B", 2**20)])
def test_swap_space_bytes(swap_space, expected):
    config = EngineConfig.from_kwargs(swap_space=swap_space, preemption_mode="swap")
    assert config.cache_config.swap_space_bytes == expected


@pytest.mark.parametrize("swap_space", [0, "0", "-1", "x", "nan", "4 GiBs"])
def test_bad_swap_space_is_refused(swap_space):
    with pytest.raises(ValueError, match=rf"memory size {swap_space!r}"):
        EngineConfig.from_kwargs(swap_space=swap_space, preemption_mode="swap")
