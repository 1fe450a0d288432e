"""Multi-LoRA serving (Hu et al. 2021): PEFT adapters loaded next to the base model and applied
per request, several adapters in one batch.

``request.py`` (pure data: which adapter a request uses), ``adapter.py`` (reading and checking a
PEFT folder), ``layers.py`` (the LoRA wrapper of a linear layer and the grouped LoRA matmul),
``sharding.py`` (a tensor-parallel rank's part of each adapter), ``manager.py`` (the runner's
adapters: registry, device slots, per-step token mapping; a pipeline stage keeps the weights of
its own layers).
"""

from kvflow.lora.request import LoRARequest

__all__ = ["LoRARequest"]
