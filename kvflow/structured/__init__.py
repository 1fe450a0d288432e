"""Structured output: constrain sampling to a JSON schema, regex, choice list, grammar or
structural tag.

``params`` (StructuredOutputsParams, no heavy imports), ``structural_tag`` (structural tags
read and checked without xgrammar), ``backend`` (the interface),
``xgrammar_backend`` (the implementation; ``xgrammar_convert``, ``xgrammar_validate`` and
``xgrammar_errors`` its conversion, check and error texts), ``lark_grammar`` (Lark grammars
to GBNF, with ``lark_expansion``, ``lark_regex`` and ``lark_common``),
``manager`` (the engine core's side: compile off the step loop, per-step token bitmask).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvflow.structured.params import StructuredOutputsParams

__all__ = ["CheckedConstraints", "StructuredOutputsParams", "validate"]


def validate(params: StructuredOutputsParams) -> None:
    """Check a constraint's schema / regex / grammar without a tokenizer.

    Raises:
        ValueError: naming the problem.
    """
    from kvflow.structured.xgrammar_validate import validate as _validate

    _validate(params)


class CheckedConstraints:
    """The constraints that passed :func:`validate`, so that each is converted once: the
    server checks a request's constraint in a worker thread, then the same constraint is
    checked again when the request is queued (``InputProcessor.make_requests``), where it is
    now found here. Remembered by ``params.digest``, a SHA-256 digest of ``params.key`` (kind
    and spec text: what ``validate`` reads), the ``capacity`` most recently used; key and
    digest (JSON text of a schema dict and its hash, milliseconds for a 400 KB schema against
    ~200 ms for its conversion) are computed once per params object, so once per request.
    Thread-safe.

    Args:
        capacity: digests kept (32 bytes each).
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, params: StructuredOutputsParams) -> None:
        """:func:`validate` ``params`` unless a constraint with the same key passed before.

        Raises:
            ValueError: as :func:`validate` (a constraint that fails is not remembered).
        """
        digest = params.digest
        with self._lock:
            if digest in self._digests:
                self._digests.move_to_end(digest)
                return
        validate(params)
        with self._lock:
            self._digests[digest] = None
            if len(self._digests) > self.capacity:
                self._digests.popitem(last=False)
