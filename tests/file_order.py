"""The order in which ``pytest -n 2`` hands out test files: costliest first.

pytest-xdist's ``--dist loadfile`` gives each worker a whole file at a time, in the order the
workers collected them (with ``--no-loadscope-reorder``, pyproject's addopts; xdist otherwise
sorts files by their number of tests, which puts the few-test, many-second files late, where
a long one leaves the other worker idle at the end). Handing out the costliest files
first (the "longest processing time first" rule of list scheduling, Graham 1969) leaves only
short files for the end, so the two workers finish close together. The costs are the seconds
a file took (set-up, calls and teardown, one worker) in a measured run, kept in
``tests/file_costs.txt`` (``scripts/file_costs.py`` writes it from a run's
``--durations=0 --durations-min=0`` output).

Files that build the same costly session-scoped state (a shared ``kvflow serve``, the SmolLM2
GGUF engine, the interpreted-Triton engine runs) are one work unit (``SHARED_STATE_GROUPS``):
``file_scheduler`` gives xdist a ``--dist loadfile`` scheduler that hands a group to one
worker, so that state is built once rather than once in each worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

COSTS_PATH = Path(__file__).with_name("file_costs.txt")
# The cost of a file the table does not list (a new one): about the median listed file's calls.
DEFAULT_COST_S = 1.0
# Files that share a costly session fixture, run by one worker (the first file names the unit).
SHARED_STATE_GROUPS: tuple[tuple[str, ...], ...] = (
    # smollm2_server, bert_embed_server and the cross-encoder and token-embedding servers
    # (start_server.shared of the same arguments): tests/e2e/conftest.py
    ("tests/e2e/test_openai_reported.py", "tests/e2e/test_openai_smollm.py",
     "tests/e2e/test_openai_score.py", "tests/e2e/test_openai_embeddings.py",
     "tests/e2e/test_openai_classify.py", "tests/e2e/test_openai_pooling_activation.py",
     "tests/e2e/test_openai_token_pooling.py"),
    # the tiny chat model's shared server (test_openai_tiny.py's SERVER_ARGS)
    ("tests/e2e/test_run_batch.py", "tests/e2e/test_openai_tiny.py",
     "tests/e2e/test_bench_serve.py", "tests/e2e/test_structured_fuzz_serve.py"),
    # the shared servers of test_openai_ops_routes.py's and test_openai_limits.py's ARGS and
    # ENV (test_unknown_fields_served.py takes both)
    ("tests/e2e/test_openai_ops_routes.py", "tests/e2e/test_openai_prompt_tokens_details.py",
     "tests/e2e/test_unknown_fields_served.py", "tests/e2e/test_openai_limits.py"),
    # the Responses model's shared server (test_openai_responses.py's SHARED_ARGS)
    ("tests/e2e/test_openai_responses_extras.py", "tests/e2e/test_openai_responses.py"),
    # qwen2_vl_server (tests/multimodal/conftest.py)
    ("tests/multimodal/test_local_media.py", "tests/multimodal/test_qwen2_vl_server.py"),
    # smollm2_llm (tests/conftest.py): the SmolLM2 GGUF engine
    ("tests/models/test_gguf_loader.py", "tests/test_stop_strings.py",
     "tests/test_detokenizer_fast_decode.py", "tests/test_chat_tools_text.py"),
    # unfused_greedy / fused_greedy (tests/kernels/conftest.py): interpreted Triton engine runs
    ("tests/kernels/test_engine_triton_cpu.py", "tests/kernels/test_fused_kernels_engine.py"),
)


def read_costs(path: Path = COSTS_PATH) -> dict[str, float]:
    """``{test file's path relative to the repository root: seconds}`` from ``path``'s
    ``seconds path`` lines (``#`` starts a comment line). {} when the file is missing.
    Raises ValueError naming the line when one is not ``seconds path``."""
    if not path.exists():
        return {}
    costs = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            costs[parts[1]] = float(parts[0])
        except ValueError:
            raise ValueError(f"{path}:{number}: expected 'seconds path', got {line!r}") from None
    return costs


def unit_of(path: str, groups: Sequence[Sequence[str]] = SHARED_STATE_GROUPS) -> str:
    """The work unit of the test file ``path`` (relative to the repository root): the first
    file of its group in ``groups``, else ``path`` itself."""
    for group in groups:
        if path in group:
            return group[0]
    return path


def costliest_files_first(items: Sequence[Any], costs: dict[str, float],
                          default: float = DEFAULT_COST_S,
                          groups: Sequence[Sequence[str]] = SHARED_STATE_GROUPS) -> list[Any]:
    """``items`` (pytest items, or anything with a ``nodeid``) reordered by work unit (a file,
    or a group of files in ``groups``): the units by descending cost (the sum of their files'
    ``costs[path]``, ``default`` for a file not listed; ties keep their collection order),
    each unit's files together (in their collection order) and each file's items together and
    in their own order. The file of an item is its node id up to the first ``::`` (as xdist's
    ``--dist loadfile`` groups them)."""
    files: dict[str, list[Any]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    units: dict[str, list[str]] = {}
    for name in files:
        units.setdefault(unit_of(name, groups), []).append(name)
    cost = {unit: sum(costs.get(name, default) for name in names)
            for unit, names in units.items()}
    order = sorted(units, key=lambda unit: -cost[unit])  # stable: ties kept
    return [item for unit in order for name in units[unit] for item in files[name]]


def grouped_loadfile_scheduling() -> type:
    """pytest-xdist's ``--dist loadfile`` scheduler class (``LoadFileScheduling``), subclassed
    so that the files of a ``SHARED_STATE_GROUPS`` group are one work unit (scope), given to
    one worker whole."""
    from xdist.scheduler import LoadFileScheduling

    class GroupedLoadFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(super()._split_scope(nodeid))

    return GroupedLoadFileScheduling


def file_scheduler(config: Any, log: Any) -> Any:
    """A :func:`grouped_loadfile_scheduling` scheduler; ``config`` and ``log`` are those of
    the ``pytest_xdist_make_scheduler`` hook."""
    return grouped_loadfile_scheduling()(config, log)
