"""``ModelConfig`` settings that another one turns off are refused, naming both, instead of
being ignored: ``--tokenizer`` with ``--skip-tokenizer-init`` (no tokenizer is loaded, so the
one named was never read, not even checked to exist)."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig
from kvflow.entrypoints.cli import main


def test_tokenizer_with_skip_tokenizer_init_is_refused():
    with pytest.raises(ValueError, match=r"^tokenizer='some/tok' is not loaded with "
                                         r"skip_tokenizer_init=True"):
        EngineConfig.from_kwargs(tokenizer="some/tok", skip_tokenizer_init=True)
    assert EngineConfig.from_kwargs(skip_tokenizer_init=True).model_config.tokenizer is None
    assert EngineConfig.from_kwargs(tokenizer="some/tok").model_config.tokenizer == "some/tok"


def test_the_two_flags_are_one_line_before_loading(capsys):
    rc = main(["generate", "--model", "/nonexistent/model", "--tokenizer", "/nonexistent/tok",
               "--skip-tokenizer-init"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvflow: error: --tokenizer='/nonexistent/tok' is not loaded "
                               "with --skip-tokenizer-init=True"), lines[0]
