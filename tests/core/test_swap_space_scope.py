"""``--swap-space`` sizes the host pool of ``--preemption-mode swap``; with ``recompute`` (the
default) there is no pool, so a size other than the default is refused, naming both flags,
instead of being ignored."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig


@pytest.mark.parametrize("swap_space", ["1MiB", "8GiB", 2**20])
def test_a_pool_size_without_swap_preemption_is_refused(swap_space):
    with pytest.raises(ValueError, match=rf"^swap_space={swap_space!r} sizes the host pool of "
                                         r"preemption_mode='swap'; this engine's is "
                                         r"'recompute'"):
        EngineConfig.from_kwargs(swap_space=swap_space)


@pytest.mark.parametrize("swap_space", ["4GiB", "4 GiB", 4 * 2**30])  # the default's size
def test_the_default_size_passes_with_recompute(swap_space):
    assert EngineConfig.from_kwargs(swap_space=swap_space).cache_config.swap_space == swap_space


def test_swap_preemption_takes_any_size():
    config = EngineConfig.from_kwargs(swap_space="1MiB", preemption_mode="swap")
    assert config.cache_config.swap_space == "1MiB"
