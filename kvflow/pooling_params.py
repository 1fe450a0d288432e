"""What an embedding request asks for beyond its prompt (pure data, crosses to the runner)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """Options of one embedding (pooling) request.

    Attributes:
        dimensions: keep the first ``dimensions`` values of the pooled vector (Matryoshka
            representation learning, Kusupati et al. 2022), normalized again when the model
            normalizes; None: the whole vector. Only for models that declare Matryoshka
            support (checked by the engine against the model).

    Raises:
        ValueError: from the constructor for ``dimensions`` < 1 or not an integer.
    """

    dimensions: int | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"PoolingParams.dimensions={d!r} must be an integer >= 1")
