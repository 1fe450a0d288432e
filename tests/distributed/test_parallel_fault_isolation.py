"""Per-request fault isolation over 2 worker processes (gloo on CPU): a request that fails
alone on ONE rank ends alone, on every rank, with its error.

Was: with ``pipeline_parallel_size=2`` the first stage (which runs the vision encoder) raised
a request's failure, so the worker died and the engine with it (``ExecutorError`` for every
request); with ``tensor_parallel_size=2`` only the driver rank's failures were reported, so a
request that failed on rank 1 alone ran on (rank 1 without its image, adapter or processor
edit: wrong tokens) and was never ended. Now a stage sends its failures down the pipeline
with its hidden states and the last stage's ranks agree on them
(``kvflow/worker/rank_failures.py``); an exception that is not one request's still fails the
engine loudly, never a hang.

The faults are injected inside the worker processes by ``RankFaults``, a custom logits
processor class each worker imports: on the global rank named by ``KVFLOW_TEST_FAULT_RANK``
(set while the workers start; unset: every rank) its per-request callable raises at a given
output length, the vision encoder raises on a solid-colour image (those cases, on the tiny
Qwen2-VL: tests/multimodal/test_encoder_fault_isolation.py), and an adapter named
``REREAD_FAILS`` cannot be read again at its request's first schedule.

Oracles: each good request's solo run on the same engine; the error's type (400
``RequestRefused`` for a ValueError, 500 ``RequestFailed`` otherwise) and field; every KV
block free and no container holding the ids afterwards, with the engine serving the next
request. About 5-10 s per engine on 2 quiet cores (20-35 s at a load average of 12).
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist

from kvflow import LLM, SamplingParams
from kvflow.core.request_errors import EXTRA_ARGS
from kvflow.engine.streams import RequestFailed, RequestRefused
from kvflow.executor import ExecutorError
from kvflow.logits_process import AdapterLogitsProcessor
from kvflow.lora.request import LoRARequest
from tests.distributed.conftest import shutdown_and_check
from tests.lora.adapters import make_adapter
from tests.test_step_fault_isolation import (
    BAD,
    GOOD,
    assert_idle_and_forgotten,
    fail_at,
    greedy,
    step_until_done,
)

HERE = "tests.distributed.test_parallel_fault_isolation"
FAULT_RANK = "KVFLOW_TEST_FAULT_RANK"
REREAD_FAILS = "reread-fails"


def _on_fault_rank() -> bool:
    want = os.environ.get(FAULT_RANK, "")
    return not want or int(want) == dist.get_rank()


class RankFaults(AdapterLogitsProcessor):
    """Per request with ``extra_args={"fail_at": n}``: raises once it has n output tokens, on
    the fault rank only (a ValueError; a RuntimeError with ``"kind": "runtime"``). Once a
    request with ``extra_args={"break_batch": True}`` was added, the batched ``apply`` itself
    raises on the fault rank (ZeroDivisionError: no request to blame). Built in a worker
    process of a multi-rank engine, it also wraps the vision encoder and the LoRA manager of
    that process (``_inject_worker_faults``)."""

    def __init__(self, config, device, is_pin_memory) -> None:
        super().__init__(config, device, is_pin_memory)
        self.broken = False
        if dist.is_available() and dist.is_initialized():
            _inject_worker_faults()

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        args = params.extra_args or {}
        if not ("fail_at" in args or args.get("break_batch")) or not _on_fault_rank():
            return None
        self.broken = self.broken or bool(args.get("break_batch"))
        return fail_at(args) if "fail_at" in args else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.broken:
            raise ZeroDivisionError("broken processor")
        return super().apply(logits)


class BrokenOnRank(RankFaults):
    """A batched processor whose ``apply`` raises on the fault rank from the first step, with
    no request asking (the Ray executor's case in test_slow_ray_and_real_models.py)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if _on_fault_rank():
            raise ZeroDivisionError("broken processor")
        return logits


def _inject_worker_faults() -> None:
    """On the fault rank of this worker process: the vision encoder raises a ValueError for
    a solid-colour image (every patch row the same), and reading the adapter ``REREAD_FAILS``
    a second time (at its request's first schedule, after ``remove_lora``) raises OSError."""
    from kvflow.lora.manager import LoRAManager
    from kvflow.worker.mm_runner import MultiModalRunner

    encode, load = MultiModalRunner._encode, LoRAManager._load
    if getattr(encode, "injected", False):
        return

    def faulty_encode(self, features):
        if _on_fault_rank() and any(bool(torch.all(p == p[:1]))
                                    for p in (f.pixel_values() for f in features)):
            raise ValueError("the encoder cannot take a solid image")
        return encode(self, features)

    def faulty_load(self, request):  # every read of a folder (add_lora, request_adapter)
        reads = self.__dict__.setdefault("test_reads", collections.Counter())
        reads[request.lora_name] += 1
        if request.lora_name == REREAD_FAILS and reads[request.lora_name] > 1 \
                and _on_fault_rank():
            raise OSError("adapter_model.safetensors vanished")
        return load(self, request)

    faulty_encode.injected = True
    MultiModalRunner._encode, LoRAManager._load = faulty_encode, faulty_load


def start(path: str, fault_rank: int | None, **kwargs) -> LLM:
    """An fp32 engine over 2 worker processes with ``RankFaults`` (faults on ``fault_rank``;
    None: every rank)."""
    kwargs.setdefault("logits_processors", [f"{HERE}:RankFaults"])
    with pytest.MonkeyPatch.context() as env:
        if fault_rank is not None:
            env.setenv(FAULT_RANK, str(fault_rank))
        else:
            env.delenv(FAULT_RANK, raising=False)
        return LLM(path, dtype="float32", num_kv_blocks=128, block_size=8, **kwargs)


@pytest.fixture(scope="module")
def tp_llama(tiny_llama):
    """TP=2, LoRA on, faults on rank 1; failed for good by the module's last engine test
    (``test_a_failure_no_request_owns_on_one_rank_fails_the_engine_loudly``), which shuts it
    down itself."""
    llm = start(tiny_llama.path, 1, tensor_parallel_size=2, enable_lora=True, max_loras=1,
                max_lora_rank=8)
    yield llm
    if llm.engine.core.executor._failed is None:
        shutdown_and_check(llm)
    else:
        llm.shutdown()


@pytest.mark.parametrize(("kind", "error_type", "match"), [
    ("value", RequestRefused, "its logits processor: fail_at=3 reached"),
    ("runtime", RequestFailed, "its logits processor failed: RuntimeError: fail_at=3"),
])
def test_a_logits_processor_failing_on_one_rank_ends_only_its_request(tp_llama, kind,
                                                                      error_type, match):
    """Rank 1's per-request processor raises, rank 0's does not: the driver (rank 0)
    reports the failure all the same, 400 for a ValueError, 500 otherwise. Was: the
    request ran to its end, with rank 1 sampling from logits rank 0 never saw."""
    solo = tp_llama.generate({"prompt_token_ids": GOOD}, greedy(),
                             use_tqdm=False)[0].outputs[0].token_ids
    engine = tp_llama.engine
    engine.add_request({"prompt_token_ids": GOOD}, greedy(), f"pf-good-{kind}")
    engine.add_request({"prompt_token_ids": BAD}, greedy(fail_at=3, kind=kind),
                       f"pf-bad-{kind}")
    tokens, errors = step_until_done(engine)
    assert tokens == {f"pf-good-{kind}": solo}
    error = errors[f"pf-bad-{kind}"]
    assert type(error) is error_type and match in str(error)
    assert error_type is RequestFailed or error.field == EXTRA_ARGS
    assert_idle_and_forgotten(tp_llama, [f"pf-good-{kind}", f"pf-bad-{kind}"])


def _reread_failure(llm: LLM, folder: str) -> tuple[list[int], dict, dict]:
    """The good request's solo tokens, then (tokens, errors) of a good request beside one
    whose adapter ``REREAD_FAILS`` must be read again at its first schedule."""
    solo = llm.generate({"prompt_token_ids": GOOD}, greedy(),
                        use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request({"prompt_token_ids": GOOD}, greedy(), "pf-good")
    engine.add_request({"prompt_token_ids": BAD}, greedy(), "pf-bad",
                       lora_request=LoRARequest(REREAD_FAILS, 1, folder))
    assert engine.core.remove_lora(1)
    return solo, *step_until_done(engine)


@pytest.mark.parametrize("where", ["tp2-rank1", "pp2-first-stage"])
def test_an_adapter_failing_on_one_rank_ends_only_its_request(tp_llama, tiny_llama, tmp_path,
                                                              where):
    """The adapter cannot be read again on one rank only (rank 1 of TP=2; the first of two
    pipeline stages, each reading its own layers' part): the request ends with a 500
    (an OSError: ``RequestFailed``) and the good request beside it gets its solo tokens.
    Was: PP=2's first stage raised (``ExecutorError``), TP=2 ran the request on with half
    an adapter."""
    folder = make_adapter(tiny_llama.path, str(tmp_path / "a"), 1, r=4, lora_alpha=8,
                          target_modules=["q_proj", "down_proj"])
    llm = tp_llama if where.startswith("tp") else \
        start(tiny_llama.path, 0, pipeline_parallel_size=2, enable_lora=True, max_loras=1,
              max_lora_rank=8)
    try:
        solo, tokens, errors = _reread_failure(llm, folder)
        assert tokens == {"pf-good": solo}
        error = errors["pf-bad"]
        assert type(error) is RequestFailed
        assert f"LoRA adapter '{REREAD_FAILS}' failed: OSError: " \
               "adapter_model.safetensors vanished" in str(error)
        assert_idle_and_forgotten(llm, ["pf-good", "pf-bad"])
    finally:
        if llm is not tp_llama:
            shutdown_and_check(llm)


@pytest.mark.timeout(120)
def test_a_failure_no_request_owns_on_one_rank_fails_the_engine_loudly(tp_llama):
    """A batched processor raising on rank 1 only cannot be charged to a request: rank 1's
    worker fails, and the executor stops rank 0 (waiting for it in a collective) and raises
    ``ExecutorError`` naming rank 1, within seconds; never a hang. (The module engine's last
    use: it stays failed.)"""
    with pytest.raises(ExecutorError, match="worker rank 1.*ZeroDivisionError: broken"):
        tp_llama.generate([{"prompt_token_ids": GOOD}, {"prompt_token_ids": BAD}],
                          greedy(3, break_batch=True), use_tqdm=False)


def test_failures_cross_ranks_as_bytes_unchanged():
    """The bytes a stage sends down the pipeline (and ranks all-gather) decode to the same
    failures (a non-ASCII message, a missing field); none: an empty tensor."""
    from kvflow.runner_output import RequestFailure
    from kvflow.worker.rank_failures import decode_failures, encode_failures

    failures = {"a": RequestFailure("image 0: größe ≠ 0", "multi_modal_data", False),
                "b": RequestFailure("its logits processor failed: KeyError: 'x'", None, True)}
    encoded = encode_failures(failures, torch.device("cpu"))
    assert encoded.dtype == torch.uint8 and encoded.dim() == 1
    assert decode_failures(encoded) == failures
    assert encode_failures({}, torch.device("cpu")).numel() == 0
    assert decode_failures(encode_failures({}, torch.device("cpu"))) == {}
