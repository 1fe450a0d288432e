"""/v1/models' cards as vLLM 0.32 writes them (``ModelCard`` and ``ModelPermission`` in
vllm/entrypoints/serve/engine/protocol.py, filled by ``OpenAIServingModels``): the base model
under each served name (``root`` the model argument, ``max_model_len``), each LoRA adapter
(``root`` its folder, ``parent`` the base model's first name), and on every card a
``permission`` list of one entry; kvflow's cards had no ``permission`` at all. The field names
and values are vLLM's source, written out by hand."""

from __future__ import annotations

import re

from kvflow.entrypoints.protocol import ModelList
from kvflow.entrypoints.serving_models import ServingModels
from kvflow.lora.request import LoRARequest

CARD_FIELDS = ["id", "object", "created", "owned_by", "root", "parent", "max_model_len",
               "permission"]
PERMISSION = {"object": "model_permission", "allow_create_engine": False,
              "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
              "allow_view": True, "allow_fine_tuning": False, "organization": "*",
              "group": None, "is_blocking": False}


def _cards() -> list[dict]:
    models = ServingModels(None, "base", aliases=("alias",))  # no engine: cards read none
    models.loras["ad"] = LoRARequest("ad", 1, "/adapters/ad")
    return ModelList(data=models.cards(256, "/models/base")).model_dump(mode="json")["data"]


def test_cards_carry_vllms_fields_and_one_permission():
    cards = _cards()
    assert [(c["id"], c["root"], c["parent"], c["max_model_len"]) for c in cards] == [
        ("base", "/models/base", None, 256), ("alias", "/models/base", None, 256),
        ("ad", "/adapters/ad", "base", 256)]
    for card in cards:
        assert list(card) == CARD_FIELDS
        (permission,) = card["permission"]
        assert re.fullmatch(r"modelperm-[0-9a-f]{32}", permission.pop("id"))
        assert abs(permission.pop("created") - card["created"]) <= 1
        assert permission == PERMISSION
