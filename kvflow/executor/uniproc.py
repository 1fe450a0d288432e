"""Executor that runs one Worker (one rank) in the engine's own process."""

from __future__ import annotations

from typing import Any

from kvflow.config import EngineConfig
from kvflow.executor.base import Executor, StepFuture
from kvflow.sched_output import DraftGrammar, GrammarBitmask, SchedulerOutput
from kvflow.worker.worker import Worker


class UniprocExecutor(Executor):
    """Single-rank executor: calls go straight to the in-process Worker (errors propagate as
    they are, so a bad step leaves the engine usable). Steps can be split, for async
    scheduling and for a draft model's constrained requests (the Worker's launch_forward /
    proposed_drafts / launch_sampling / collect_output, which record its step statistics).

    Raises:
        ValueError: from the constructor for a bad model or configuration.
    """

    supports_async_scheduling = True
    runs_in_process = True
    splits_draft_steps = True

    def __init__(self, config: EngineConfig, source: Any, hf_config: Any, dtype: Any) -> None:
        super().__init__(config, source, hf_config, dtype)
        self.worker = Worker(config, 0, 0, "", source, hf_config, dtype)

    @property
    def runner(self):
        """The in-process ModelRunner (for tests and tools)."""
        return self.worker.runner

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def freeze_worker_heaps(self) -> None:
        """Nothing: the worker runs in the engine's process, which is the caller's (offline
        ``LLM``) or freezes itself (the engine-core process)."""

    def execute_model_async(self, sched: SchedulerOutput,
                            grammar_bitmask: GrammarBitmask | None = None) -> StepFuture:
        return StepFuture.done(self.worker.execute_model(sched, grammar_bitmask))

    def execute_model(self, sched: SchedulerOutput,
                      grammar_bitmask: GrammarBitmask | None = None) -> Any:
        return self.worker.execute_model(sched, grammar_bitmask)

    def launch_forward(self, sched: SchedulerOutput,
                       first_grammar: GrammarBitmask | None = None,
                       draft_grammar: DraftGrammar | None = None) -> None:
        self.worker.launch_forward(sched, first_grammar, draft_grammar)

    def proposed_drafts(self) -> dict[str, list[int]]:
        return self.worker.proposed_drafts()

    def launch_sampling(self, grammar_bitmask: GrammarBitmask | None = None) -> None:
        self.worker.launch_sampling(grammar_bitmask)

    def collect_output(self) -> Any:
        return self.worker.collect_output()

    def discard_output(self) -> None:
        self.worker.discard_output()

    def shutdown(self) -> None:
        self.worker.shutdown()
