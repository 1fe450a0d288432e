"""Custom logits processors (vLLM v1's engine-level kind): user classes that edit each step's
logits before sampling, configured once per engine.

A processor subclasses :class:`LogitsProcessor`; the engine builds one instance per model
runner (every tensor-parallel rank has its own) with ``(config, device, is_pin_memory)``,
tells it how the persistent batch changed before each step that samples
(``update_state(BatchUpdate | None)``, see ``kvflow.batch_update``) and calls
``apply(logits)`` on the step's logits, float32 [batch_size, vocab]: row ``i`` is the request
the updates put at row ``i``. Requests pass their own arguments in
``SamplingParams.extra_args`` (``vllm_xargs`` in a server request body), which
``validate_params`` checks when the request is queued.

Where they run in the sampler (``kvflow/layers/sampler.py``), as in vLLM v1: processors that
can change the argmax (``is_argmax_invariant()`` False) after ``logit_bias`` and before the
presence / frequency / repetition penalties; argmax-invariant ones after temperature and
min-p (vLLM's built-in argmax-invariant processor, which it runs first), before top-k and
top-p, only when some row samples at random (greedy rows never see their edits).

Load them with ``LLM(logits_processors=[Class or "module.path:Class"])`` or
``kvflow serve --logits-processors module.path:Class``, or install them as plugins: every
entry point of the ``kvflow.logits_processors`` group (vLLM's ``vllm.logits_processors``
under kvflow's name) is loaded at start-up, before the configured ones
(``plugin_logits_processors``). :class:`AdapterLogitsProcessor` wraps per-request callables
``fn(output_token_ids, logits_row) -> logits_row``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from kvflow.batch_update import (
    AddedRequest,
    BatchUpdate,
    MoveDirectionality,
    apply_batch_update,
)
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch is not imported at run time: the config imports this module
    import torch

    from kvflow.config import EngineConfig

__all__ = ["LOGITS_PROCESSORS_GROUP", "AdapterLogitsProcessor", "BatchUpdate",
           "LogitsProcessor", "MoveDirectionality", "RequestLogitsProcessor",
           "load_logits_processors", "plugin_logits_processors"]

LOGITS_PROCESSORS_FLAG = "--logits-processors (logits_processors)"
# the entry-point group of installed logits processor plugins (vLLM's: vllm.logits_processors)
LOGITS_PROCESSORS_GROUP = "kvflow.logits_processors"

# fn(output_token_ids, logits_row) or fn(prompt_token_ids, output_token_ids, logits_row):
# logits_row is float32 [vocab]; returns the edited row (in place or a new tensor).
RequestLogitsProcessor = Callable[..., Any]


class LogitsProcessor(ABC):
    """One engine's custom logits processor (one instance per model runner).

    Args (of the constructor every subclass takes):
        config: the engine's ``EngineConfig``.
        device: where the logits live.
        is_pin_memory: whether pinned host memory is available (CUDA) for host -> device
            copies of the processor's own tensors.
    """

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Check a request's parameters (its ``extra_args`` mostly) when it is queued.

        Raises:
            ValueError: for arguments the processor cannot use (the request is refused; a
                400 on the server).
        """

    @abstractmethod
    def __init__(self, config: EngineConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        ...

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token has the largest logit (it then
        runs after temperature, for random sampling only, and greedy rows skip it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Take the persistent batch's changes since the last call (None: none), before
        ``apply`` of a step. The generated-token lists handed over in ``added`` already hold
        every token sampled before this step."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit ``logits`` (float32 [batch_size, vocab], row = batch row; rows of requests
        that do not sample this step are ignored afterwards) in place or return a new tensor
        of the same shape. An exception raised here fails the whole step (every request in
        it): a processor that can tell which row failed reports it with
        ``take_row_failures`` instead."""

    def take_row_failures(self) -> dict[int, Exception]:
        """The rows whose request the last ``apply`` could not process (row -> what it
        raised), forgotten once taken: the engine ends those requests alone with that
        error (a ValueError: the request's bad arguments, a 400; else a 500) and leaves the
        row's logits as ``apply`` left them (its token is dropped). Default: none."""
        return {}


class AdapterLogitsProcessor(LogitsProcessor):
    """A :class:`LogitsProcessor` made of per-request callables (vLLM's adapter for the
    older per-request processors): subclasses implement ``is_argmax_invariant`` and
    ``new_req_logits_processor(params)``, which returns the request's callable
    (:data:`RequestLogitsProcessor`) or None when the request does not use it. ``apply``
    calls each row's callable on that row, one row at a time (a Python loop over the rows
    that use it: write a batched :class:`LogitsProcessor` when speed matters)."""

    def __init__(self, config: EngineConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self.config, self.device = config, device
        self.row_fns: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._row_failures: dict[int, Exception] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams
                                 ) -> RequestLogitsProcessor | None:
        """The callable for a request with ``params`` (None: the request does not use it)."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        apply_batch_update(self.row_fns, batch_update, self._bind)

    def _bind(self, added: AddedRequest) -> Callable[[torch.Tensor], torch.Tensor] | None:
        _, params, prompt_ids, output_ids = added
        try:
            fn = self.new_req_logits_processor(params)
        except Exception as e:  # noqa: BLE001 - this request's alone: its row fails in apply
            _raise_if_engine_fault(e)
            return partial(_raise, e)
        if fn is None:
            return None
        if _num_positional(fn) == 3:
            return partial(fn, prompt_ids, output_ids)
        return partial(fn, output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's callable on its row; a callable that raises (or whose request's
        ``new_req_logits_processor`` raised) leaves its row as it was and is reported by
        ``take_row_failures``: only its request fails."""
        for row, fn in self.row_fns.items():
            try:
                logits[row] = fn(logits[row])
            except Exception as e:  # noqa: BLE001 - one request's callable: its failure alone
                _raise_if_engine_fault(e)
                self._row_failures[row] = e
        return logits

    def take_row_failures(self) -> dict[int, Exception]:
        failures, self._row_failures = self._row_failures, {}
        return failures


def _raise(error: Exception, *args: Any) -> Any:
    raise error


def _raise_if_engine_fault(error: Exception) -> None:
    """Re-raise ``error`` when it is not one request's to bear (out of memory)."""
    from kvflow.worker.request_failures import is_request_fault  # torch: not at import
    if not is_request_fault(error):
        raise error


def _num_positional(fn: Callable[..., Any]) -> int:
    """How many positional parameters ``fn`` takes (2 or 3 for a request's processor)."""
    params = inspect.signature(fn).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params)


def load_logits_processors(specs: Sequence[str | type] | None
                           ) -> tuple[type[LogitsProcessor], ...]:
    """The processor classes ``specs`` names: classes as given, strings imported
    (``"module.path:Class"``, or ``"module.path.Class"``); empty for None.

    Raises:
        ValueError: naming ``--logits-processors (logits_processors)``, for a string that
            does not import, a name that is not a class, or a class that does not subclass
            :class:`LogitsProcessor`.
    """
    if specs is None:
        return ()
    if isinstance(specs, (str, type)):
        specs = [specs]
    return tuple(_load_one(spec) for spec in specs)


def plugin_logits_processors(group: str = LOGITS_PROCESSORS_GROUP) -> list[str]:
    """The class paths (``"module.path:Class"``) of the installed logits processor plugins:
    the entry points of ``group`` (a package declares one in its ``pyproject.toml`` as
    ``[project.entry-points."kvflow.logits_processors"] name = "module.path:Class"``), in
    the order ``importlib.metadata`` lists them, each once; each is imported and checked.

    Raises:
        ValueError: naming the group and the entry point, for one that does not import or
            does not name a :class:`LogitsProcessor` subclass (the engine does not start,
            as vLLM's does not).
    """
    specs: list[str] = []
    for entry in importlib.metadata.entry_points(group=group):
        try:
            _load_one(entry.value)
        except ValueError as e:
            raise ValueError(f"logits processor plugin {entry.name!r} = {entry.value!r} "
                             f"(entry point group {group!r}): {e}") from None
        if entry.value not in specs:
            specs.append(entry.value)
    return specs


def _load_one(spec: str | type) -> type[LogitsProcessor]:
    cls = _import_class(spec) if isinstance(spec, str) else spec
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{LOGITS_PROCESSORS_FLAG}: {spec!r} is not a subclass of "
            "kvflow.logits_process.LogitsProcessor")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"{LOGITS_PROCESSORS_FLAG}: {cls.__qualname__} does not implement "
                         f"{missing}")
    return cls


def _import_class(spec: str) -> Any:
    module_name, sep, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not (module_name and sep and name):
        raise ValueError(f"{LOGITS_PROCESSORS_FLAG}: {spec!r} is not a class path; give "
                         "'module.path:ClassName'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{LOGITS_PROCESSORS_FLAG}: cannot import module {module_name!r} "
                         f"of {spec!r}: {e}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{LOGITS_PROCESSORS_FLAG}: module {module_name!r} has no "
                             f"{name!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj
