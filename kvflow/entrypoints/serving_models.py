"""The names a server answers to: the base model and its LoRA adapters.

A request's ``model`` field picks the base model (its served name) or a LoRA adapter (its
name), as in vLLM. Adapters come from ``--lora-modules NAME=PATH`` at start-up or
``POST /v1/load_lora_adapter`` later, and leave with ``POST /v1/unload_lora_adapter``. Each
load gets a fresh ``lora_int_id``, so an adapter reloaded under the same name never shares
prefix-cache blocks or device slots with the old one.
"""

from __future__ import annotations

import itertools
from collections import Counter

from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.protocol import ModelCard
from kvflow.lora.request import LoRANameError, LoRARequest, check_lora_name, lora_name_problem


class ModelNotFound(LookupError):
    """A ``model`` (or ``lora_name``) the server does not serve."""


class ServingModels:
    """Base model name + LoRA adapters by name.

    Args:
        engine: the running AsyncLLM (adapters are loaded by its engine core).
        base_name: the base model's served name.
        enable_lora: whether the server was started with ``--enable-lora`` (without it,
            ``model`` can only name the base model, and errors about it say so).
        aliases: the base model's other served names (``--served-model-name`` given
            several: vLLM's aliases), each accepted as ``model`` for the base model.
    """

    def __init__(self, engine: AsyncLLM, base_name: str, enable_lora: bool = True,
                 aliases: tuple[str, ...] = ()) -> None:
        self.engine, self.base_name, self.enable_lora = engine, base_name, enable_lora
        self.base_names = (base_name, *aliases)
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._loading: Counter[str] = Counter()  # name -> its loads still in the engine

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model, also for an omitted model).

        Raises:
            LoRANameError: (a ValueError) for a name no model can have: empty, whitespace
                only or holding a control character (without ``enable_lora``, naming the
                served model instead of the rule for adapter names).
            ModelNotFound: for a name that is neither the base model nor a loaded adapter.
        """
        if model is None or model in self.base_names:
            return None
        why = lora_name_problem(model)
        if why is not None and not self.enable_lora:  # no adapter names to speak of
            raise LoRANameError(f"model {model!r} {why}: send the served model's name, "
                                f"{self.base_name!r} (or leave model out)")
        check_lora_name(model, "model")
        lora = self.loras.get(model)
        if lora is None:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves "
                                f"{self.names()}")
        return lora

    def names(self) -> list[str]:
        """Every name ``model`` may take: the base model's served names, then the adapters."""
        return [*self.base_names, *self.loras]

    async def load(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """Load an adapter in the engine (read and checked there) and serve it as ``name``.

        With ``replace`` (vLLM's ``load_inplace``), an adapter already served as ``name`` is
        replaced once the new one has loaded (requests running with the old one finish with
        it; the new one gets a fresh ``lora_int_id``, so no prefix-cache block computed with
        the old weights is reused); if the new one is refused, the old one stays.

        Raises:
            LoRANameError: (a ValueError) for a name that is empty, whitespace only or holds
                a control character, or is one of the base model's served names (with or
                without ``replace``).
            ValueError: for a name in use or still being loaded by another request
                (without ``replace``), or an adapter the engine refuses (rank above
                --max-lora-rank, target modules kvflow cannot adapt, no --enable-lora, ...).
        """
        check_lora_name(name)
        if name in self.base_names:  # never an adapter's: load_inplace cannot take it either
            raise LoRANameError(f"lora_name {name!r} is a name of the served model "
                                "(--served-model-name): give the adapter another name")
        loading = " (by a request whose load is still running)" \
            if name not in self.loras and self._loading[name] else ""
        if not replace and (name in self.loras or loading):
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded"
                             f"{loading}; send load_inplace: true to replace it")
        lora = LoRARequest(name, next(self._ids), path)
        self._loading[name] += 1
        try:
            await self.engine.add_lora(lora)
        finally:
            self._loading[name] -= 1
            if not self._loading[name]:
                del self._loading[name]
        old = self.loras.get(name)
        self.loras[name] = lora
        if old is not None:
            await self.engine.remove_lora(old.lora_int_id)
        return lora

    async def unload(self, name: str) -> None:
        """Stop serving adapter ``name`` (requests already running with it finish with it).

        Raises:
            ModelNotFound: when no adapter of that name is loaded.
        """
        lora = self.loras.pop(name, None)
        if lora is None:
            raise ModelNotFound(f"the LoRA adapter {name!r} cannot be found")
        await self.engine.remove_lora(lora.lora_int_id)

    def cards(self, max_model_len: int, root: str) -> list[ModelCard]:
        """/v1/models: the base model under each of its served names, then each adapter
        (its ``parent`` the base model's first name)."""
        bases = [ModelCard(id=name, root=root, max_model_len=max_model_len)
                 for name in self.base_names]
        return [*bases, *(ModelCard(id=name, root=lora.lora_path, parent=self.base_name,
                                    max_model_len=max_model_len)
                          for name, lora in self.loras.items())]
