"""A ``model`` no model can have (empty, whitespace only, a control character): without
--enable-lora the error says what is wrong and names the served model (it gave the rule for
LoRA adapters' names on a server that takes none); with it, that rule. Hand-written messages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvflow.entrypoints.serving_models import ServingModels
from kvflow.lora.request import LoRANameError


@pytest.mark.parametrize("model, why", [("", "is empty"), ("  ", "is whitespace only"),
                                        ("a\x00", "holds the control character U+0000")])
def test_bad_model_name_with_and_without_lora(model, why):
    plain = ServingModels(SimpleNamespace(), "tiny", enable_lora=False)
    with pytest.raises(LoRANameError) as e:
        plain.resolve(model)
    assert str(e.value) == (f"model {model!r} {why}: send the served model's name, 'tiny' "
                            "(or leave model out)")
    with pytest.raises(LoRANameError) as e:
        ServingModels(SimpleNamespace(), "tiny", enable_lora=True).resolve(model)
    assert str(e.value) == (f"model {model!r} {why}: a LoRA adapter's name must hold visible "
                            "characters and no control characters")
    assert plain.resolve("tiny") is None and plain.resolve(None) is None
