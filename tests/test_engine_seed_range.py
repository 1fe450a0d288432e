"""The engine seed (``--seed``, ``LLM(seed=...)``) is refused before any model loads when
torch's generators cannot take it (outside [-2**63, 2**64))."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig
from kvflow.entrypoints.cli import main

# torch.Generator.manual_seed takes any integer in [-2**63, 2**64) (a negative one wraps)
SEED_LOW, SEED_HIGH = -2**63, 2**64 - 1


@pytest.mark.parametrize("seed", [SEED_LOW, -1, 0, 2**63, SEED_HIGH])
def test_seeds_torch_takes_are_kept(seed):
    assert EngineConfig.from_kwargs(seed=seed).model_config.seed == seed


@pytest.mark.parametrize("seed", [SEED_LOW - 1, SEED_HIGH + 1, 2**70])
def test_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(ValueError, match=rf"^seed={seed} is out of range"):
        EngineConfig.from_kwargs(seed=seed)


def test_seed_flag_out_of_range_is_one_line_before_loading(capsys):
    """The model does not exist: the seed is refused first, naming the flag (it used to fail
    after the weights loaded, as torch's 'Overflow when unpacking long long')."""
    rc = main(["generate", "--model", "/nonexistent/model", "--seed", str(2**64)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kvflow: error: --seed={2**64} is out of range"), lines[0]
