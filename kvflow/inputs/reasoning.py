"""The reasoning options of the offline ``LLM`` and of ``AsyncLLM``, vLLM's engine arguments
of the same names: ``reasoning_parser`` (the server's ``--reasoning-parser`` names),
``reasoning_config`` (``{"reasoning_start_str": ..., "reasoning_end_str": ...}``, whose
strings win over the parser's) and ``structured_outputs_config``
(``{"enable_in_reasoning": bool}``).

The markers are tokenized once, when the ``LLM`` or ``AsyncLLM`` is built
(``kvflow.sampling.reasoning_markers``), and given to each request that needs them
(:meth:`OfflineReasoning.apply`): one with a ``thinking_token_budget`` (vLLM 0.32 refuses a
budget without them), and one with ``structured_outputs``, whose grammar then starts after
the reasoning, as vLLM's does with a reasoning parser
(``kvflow/structured/reasoning_gate.py``), unless ``enable_in_reasoning``. As in vLLM, these
outputs carry no separate reasoning: ``CompletionOutput.text`` is the whole reply, think
block included. (The server reads its own ``--reasoning-parser`` and fills its requests'
markers itself: its ``AsyncLLM`` gets none of these options.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvflow.config.reasoning import (
    REASONING_OPTIONS,
    check_reasoning_parser,
    marker_strings,
    reasoning_config,
)
from kvflow.config.server_values import structured_outputs_config
from kvflow.sampling.reasoning_markers import marker_token_ids
from kvflow.sampling_params import SamplingParams
from kvflow.thinking_budget import ReasoningTokenIds

#: the ``LLM(...)`` and ``AsyncLLM(...)`` keywords this module reads
OPTIONS = REASONING_OPTIONS


@dataclass(frozen=True)
class ReasoningOptions:
    """The options read, before the model loads: the marker strings (start, end; None: none
    named) and whether a grammar applies from the first token (``enable_in_reasoning``, or
    markers from ``reasoning_config`` without a parser, as the server reads them)."""

    markers: tuple[str, str] | None
    grammar_in_reasoning: bool

    @classmethod
    def pop(cls, kwargs: dict[str, Any]) -> ReasoningOptions:
        """Remove :data:`OPTIONS` from ``kwargs`` (``LLM``'s keywords) and check them.

        Raises:
            ValueError: for an unknown ``reasoning_parser`` (listing the choices), or a bad
                ``reasoning_config`` or ``structured_outputs_config``, naming it.
        """
        return cls.read(*(kwargs.pop(name, None) for name in OPTIONS))

    @classmethod
    def read(cls, parser: Any, config: Any, outputs: Any) -> ReasoningOptions:
        """:data:`OPTIONS`' values (``reasoning_parser``, ``reasoning_config``,
        ``structured_outputs_config``; None: not given) checked: ``AsyncLLM``'s keywords,
        and ``LLM``'s through :meth:`pop`.

        Raises:
            ValueError: as :meth:`pop`.
        """
        parser = check_reasoning_parser(parser)
        config = reasoning_config(config)
        outputs = structured_outputs_config(outputs)
        markers = marker_strings(parser, config)
        # markers from reasoning_config alone serve the budget: vLLM's grammar waits only
        # for a parser's end of reasoning
        alone = parser is None and markers is not None
        return cls(markers, alone or bool((outputs or {}).get("enable_in_reasoning")))


@dataclass(frozen=True)
class OfflineReasoning:
    """An ``LLM``'s or ``AsyncLLM``'s reasoning markers (None: none named) and whether a
    grammar applies in the reasoning too (``enable_in_reasoning``)."""

    ids: ReasoningTokenIds | None = None
    grammar_in_reasoning: bool = False

    @classmethod
    def of(cls, options: ReasoningOptions, tokenizer: Any) -> OfflineReasoning:
        """``options``' markers tokenized with ``tokenizer`` (the engine's; None under
        ``skip_tokenizer_init``).

        Raises:
            ValueError: as :func:`kvflow.sampling.reasoning_markers.marker_token_ids`.
        """
        return cls(marker_token_ids(options.markers, tokenizer), options.grammar_in_reasoning)

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the markers for its budget or grammar (a copy; ``params`` when
        nothing changes: no markers here, or none needed, or its own
        ``reasoning_token_ids``, which win), and ``grammar_in_reasoning`` set under
        ``enable_in_reasoning``."""
        ids = params.reasoning_token_ids or self.ids
        constrained = params.structured_outputs is not None
        budget = params.thinking_token_budget is not None
        if ids is None or not (constrained or budget):
            return params
        changes: dict[str, Any] = {}
        if params.reasoning_token_ids is None and (budget or not self.grammar_in_reasoning):
            changes["reasoning_token_ids"] = ids
        if constrained and self.grammar_in_reasoning and not params.grammar_in_reasoning:
            changes["grammar_in_reasoning"] = True
        if not changes:
            return params
        copy = dataclasses.replace(params, **changes)
        copy._fields_set = params.fields_set  # the model's defaults still fill the others
        return copy
