"""Custom logits processors (kvflow.logits_process, vLLM v1's engine-level kind) and
SamplingParams.extra_args.

Oracles: greedy engine output against a plain torch loop over transformers' logits with the
same edits (a banned token id, a token forced every k-th generated token), whose top-1
margin is asserted at every free step, for a batch of requests with different lengths (rows
move as they finish; later requests take their rows) and a step budget that splits prompts
into chunks (rows that do not sample); the BatchUpdates the runner sends against the batch's
own rows after random adds and removals; a seeded random-sampling run with an
argmax-invariant processor (top-1 kept) against the greedy reference.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.batch_update import AddedRequest, BatchUpdate, apply_batch_update
from kvflow.config import EngineConfig
from kvflow.logits_process import AdapterLogitsProcessor, LogitsProcessor
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.logits_procs import RunnerLogitsProcessors
from kvflow.worker.request_state import RequestState
from tests.test_input_batch import FULL

MARGIN = 1e-3  # smallest top-1 lead over the runner-up the reference accepts
NEG_INF = float("-inf")
HERE = "tests.test_logits_processors"


class BanToken(LogitsProcessor):
    """Batched: -inf at ``extra_args["ban_token"]`` in the rows of requests that set it."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        token = (params.extra_args or {}).get("ban_token")
        if token is not None and not (isinstance(token, int) and token >= 0):
            raise ValueError(f"ban_token={token!r} must be a token id")

    def __init__(self, config, device, is_pin_memory) -> None:
        self.banned: dict[int, int] = {}  # row -> token id

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        apply_batch_update(self.banned, batch_update,
                           lambda added: (added[1].extra_args or {}).get("ban_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.banned:
            rows = torch.tensor(list(self.banned), dtype=torch.int64)
            logits[rows, torch.tensor(list(self.banned.values()))] = NEG_INF
        return logits


def _forcing(token: int, every: int):
    def force(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        if (len(output_ids) + 1) % every:
            return row
        forced = torch.full_like(row, NEG_INF)
        forced[token] = 0.0
        return forced
    return force


class ForceEvery(AdapterLogitsProcessor):
    """Per request: every ``extra_args["every"]``-th generated token is
    ``extra_args["force_token"]`` (reads the request's generated-token list)."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        args = params.extra_args or {}
        if "force_token" in args and not (isinstance(args.get("every"), int)
                                          and args["every"] >= 1):
            raise ValueError("force_token needs every, a step count >= 1")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        args = params.extra_args or {}
        if "force_token" not in args:
            return None
        return _forcing(args["force_token"], args["every"])


class KeepTop1(LogitsProcessor):
    """Argmax-invariant: every logit but each row's largest is -inf (sampling becomes
    greedy), for requests with ``extra_args["top1"]``."""

    def __init__(self, config, device, is_pin_memory) -> None:
        self.rows: dict[int, bool] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        apply_batch_update(self.rows, batch_update,
                           lambda added: (added[1].extra_args or {}).get("top1"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row in self.rows:
            top = logits[row].argmax()
            value = logits[row, top].item()
            logits[row] = NEG_INF
            logits[row, top] = value
        return logits


# ---- the engine against transformers ----------------------------------------------------------
def _reference(hf_model, prompt: list[int], steps: int, ban: int | None = None,
               force: tuple[int, int] | None = None) -> list[int]:
    """Greedy tokens over transformers' logits with the ban, then the forcing, applied."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].clone()
        if ban is not None:
            logits[ban] = NEG_INF
        if force is not None and (len(out) + 1) % force[1] == 0:
            out.append(force[0])
            continue
        top = logits.topk(2).values
        assert top[0] - top[1] > MARGIN, (prompt, out, top)
        out.append(int(logits.argmax()))
    return out


PROMPTS = ["the quick brown fox", "kvflow pages keys and values", "prefix caching reuses them",
           "a b c d e f g h i j k l", "hello there", "one two three four five six"]
MAX_TOKENS = [3, 9, 5, 12, 4, 8]  # rows finish at different steps and move


def _cases(tiny_llama, tiny_tokenizer) -> list[tuple[list[int], int, dict]]:
    """(prompt ids, max_tokens, extra_args) per request: a ban of the request's own first
    greedy token (the ban always bites), a forced token every 2nd or 3rd step, both, or
    neither."""
    cases = []
    for i, (text, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        ids = tiny_tokenizer.encode(text)
        args: dict = {}
        if i % 3 != 2:
            args["ban_token"] = _reference(tiny_llama.hf_model, ids, 1)[0]
        if i % 2:
            args.update(force_token=40 + i, every=2 + i % 3)
        cases.append((ids, n, args))
    return cases


def _expected(tiny_llama, cases) -> list[list[int]]:
    out = []
    for ids, n, args in cases:
        force = (args["force_token"], args["every"]) if "force_token" in args else None
        tokens = _reference(tiny_llama.hf_model, ids, n, args.get("ban_token"), force)
        if args:
            assert tokens != _reference(tiny_llama.hf_model, ids, n)  # the oracle bites
        out.append(tokens)
    return out


@pytest.mark.parametrize("specs,async_scheduling,num_kv_blocks", [
    ([BanToken, ForceEvery], False, 64),
    ([f"{HERE}:BanToken", f"{HERE}.ForceEvery"], False, 64),
    ([BanToken, ForceEvery], True, 64),  # a step's tokens reach the host after the next launch
    ([BanToken, ForceEvery], False, 13),  # preempted requests come back with their tokens
], ids=["classes", "class_paths", "async_scheduling", "preemption"])
def test_greedy_outputs_match_transformers_with_the_same_edits(tiny_llama, tiny_tokenizer,
                                                              specs, async_scheduling,
                                                              num_kv_blocks, assert_no_leaks):
    """Three rows at a time (max_num_seqs): each finished request's row is taken by the
    last row's request and the queued ones are added; a 6-token step budget splits prompts
    into chunks while other rows decode, so some steps sample only some rows; with 13 KV
    blocks requests are preempted and re-added with the tokens they had."""
    cases = _cases(tiny_llama, tiny_tokenizer)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu",
              num_kv_blocks=num_kv_blocks, block_size=4, max_num_seqs=3,
              max_num_batched_tokens=6, enable_chunked_prefill=True, logits_processors=specs,
              async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             extra_args=args or None) for _, n, args in cases]
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in cases], params,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _expected(tiny_llama, cases)
    assert (llm.engine.core.scheduler.num_preemptions > 0) == (num_kv_blocks == 13)
    assert_no_leaks(llm)


def test_an_argmax_invariant_processor_runs_for_random_sampling_only(tiny_llama,
                                                                    tiny_tokenizer):
    """KeepTop1 leaves one token per row: seeded random sampling then gives the greedy
    tokens (and does not without it); greedy rows never see it (nor would they change)."""
    ids = tiny_tokenizer.encode(PROMPTS[0])
    greedy = _reference(tiny_llama.hf_model, ids, 8)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
              block_size=4, logits_processors=[KeepTop1])
    prompt = {"prompt_token_ids": ids}
    sampled = [SamplingParams(temperature=1.5, seed=s, max_tokens=8, ignore_eos=True,
                              extra_args={"top1": True}) for s in range(3)]
    free = SamplingParams(temperature=1.5, seed=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([prompt] * 4, [*sampled, free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == [greedy] * 3
    assert outs[3].outputs[0].token_ids != greedy


def test_min_p_runs_before_the_argmax_invariant_processors():
    """vLLM's order after temperature: its built-in min-p processor, then the custom
    argmax-invariant ones, then top-k / top-p. A processor that flattens the row (logits
    halved: argmax-invariant) must not change which tokens min-p keeps; it ran before min-p,
    which then kept more tokens. Checked on what the row samples from (processed logprobs)
    against plain torch in vLLM's order."""
    from kvflow.layers.sampler import Sampler
    from kvflow.layers.sampling_metadata import SamplingMetadata

    class Halve:
        def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
            return logits * 0.5 if argmax_invariant else logits

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -1.0]])
    temperature, min_p = 0.8, 0.2
    meta = SamplingMetadata(temperature=torch.tensor([temperature]),
                            min_p=torch.tensor([min_p]), num_logprobs={0: 6})
    out = Sampler(torch.Generator().manual_seed(0), "processed_logprobs")(
        logits.clone(), meta, Halve())
    scaled = logits[0] / temperature
    probs = torch.softmax(scaled, -1)
    expected = torch.log_softmax((scaled * 0.5).masked_fill(probs < min_p * probs.max(),
                                                            NEG_INF), -1)
    assert torch.isfinite(expected).tolist() == [True, True, False, False, False, False]
    top_ids, top_lps, _, _ = out.logprobs_lists()[0]
    torch.testing.assert_close(torch.tensor(top_lps), expected[top_ids])


def test_validate_params_refuses_a_request(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=16,
              block_size=4, logits_processors=[BanToken])
    with pytest.raises(ValueError, match=r"ban_token='x' must be a token id"):
        llm.generate({"prompt_token_ids": [5, 6]},
                     SamplingParams(max_tokens=2, extra_args={"ban_token": "x"}),
                     use_tqdm=False)


def test_extra_args_without_processors_are_refused(tiny_llama):
    """Without logits processors nothing would read extra_args: a ValueError naming them (the
    server's 400 names vllm_xargs: tests/e2e/test_openai_fields.py); none set, the engine
    generates as usual."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=16,
              block_size=4)
    with pytest.raises(ValueError, match=r"SamplingParams.extra_args is read only by custom"):
        llm.generate({"prompt_token_ids": [5, 6]},
                     SamplingParams(max_tokens=2, extra_args={"ban_token": 3}), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2


# ---- start-up refusals ------------------------------------------------------------------------
@pytest.mark.parametrize("spec,why", [
    ("no_such_module_xyz:Thing", "cannot import module 'no_such_module_xyz'"),
    (f"{HERE}:Missing", "has no 'Missing'"),
    ("not a path", "is not a class path"),
    ("kvflow.sampling_params:SamplingParams", "is not a subclass of"),
    (SamplingParams, "is not a subclass of"),
    (AdapterLogitsProcessor,
     "does not implement is_argmax_invariant, new_req_logits_processor"),
])
def test_a_bad_class_is_refused_at_start_up_naming_the_flag(spec, why):
    with pytest.raises(ValueError) as e:
        LLM(model="/nonexistent/model/folder", logits_processors=[spec])
    assert str(e.value).startswith("--logits-processors (logits_processors): ")
    assert why in str(e.value)


def test_the_cli_flag_and_config_file_take_class_paths(tmp_path):
    from kvflow.entrypoints.cli import build_parser
    from kvflow.entrypoints.config_file import expand_config_file

    parser = build_parser()
    args = parser.parse_args(["serve", "--logits-processors", f"{HERE}:BanToken",
                              f"{HERE}:ForceEvery"])
    assert EngineConfig.from_cli_args(args).model_config.logits_processors == \
        [f"{HERE}:BanToken", f"{HERE}:ForceEvery"]
    config = tmp_path / "engine.yaml"
    config.write_text(f"logits-processors: [{HERE}:BanToken, {HERE}:ForceEvery]\n")
    args = parser.parse_args(expand_config_file(parser, ["serve", "--config", str(config)]))
    assert EngineConfig.from_cli_args(args).model_config.logits_processors == \
        [f"{HERE}:BanToken", f"{HERE}:ForceEvery"]
    with pytest.raises(ValueError, match=r"^--logits-processors \(logits_processors\): "):
        EngineConfig.from_cli_args(build_parser().parse_args(
            ["serve", "--logits-processors", "kvflow.offline.llm:LLM"]))


def test_speculative_decoding_is_refused_with_processors():
    with pytest.raises(ValueError, match=r"speculative decoding \(method='ngram'\) with custom "
                                         r"logits processors \(--logits-processors\)"):
        EngineConfig.from_kwargs(logits_processors=[BanToken],
                                 speculative_config={"method": "ngram"})


@pytest.mark.parametrize("extra_args,why", [
    ({1: 2}, "must be a dict with string keys"),
    (["ban_token"], "must be a dict with string keys"),
    ({"f": object()}, "its values must be None, bools, numbers, strings"),
])
def test_extra_args_that_cannot_reach_the_engine_are_refused(extra_args, why):
    with pytest.raises(ValueError, match=r"^SamplingParams\.extra_args=") as e:
        SamplingParams(extra_args=extra_args)
    assert why in str(e.value)


# ---- the runner's batch updates ---------------------------------------------------------------
def test_batch_updates_keep_each_processor_row_on_its_request():
    """Random adds (new and re-added requests) and removals on a real InputBatch; after each
    step a processor keeping ``row -> request id`` through the updates (vLLM's order) must
    see the batch's own rows, and each request's generated-token list its tokens."""
    rng = random.Random(0)
    seen: dict[int, str] = {}

    class RowIds(LogitsProcessor):
        def __init__(self, config, device, is_pin_memory) -> None:
            self.outputs: dict[int, list[int]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            def entry(added: AddedRequest) -> tuple[str, list[int]]:
                return added[1].extra_args["rid"], added[3]
            states = {row: (rid, self.outputs[row]) for row, rid in seen.items()}
            apply_batch_update(states, batch_update, entry)
            seen.clear()
            seen.update({row: rid for row, (rid, _) in states.items()})
            self.outputs = {row: out for row, (_, out) in states.items()}

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits

    procs = RunnerLogitsProcessors([RowIds], None, torch.device("cpu"))
    batch = InputBatch(8, [FULL])
    states: dict[str, RequestState] = {}
    for step in range(300):
        for _ in range(rng.randint(0, 2)):
            if batch.num_reqs and rng.random() < 0.6:
                batch.remove_request(rng.choice(batch.req_ids))
        for k in range(rng.randint(0, 2)):
            if batch.num_reqs == 8:
                break
            gone = [r for r in states if r not in batch.req_id_to_index]
            # a request back after a preemption (maybe removed this very step), or a new one
            rid = rng.choice(gone) if gone and rng.random() < 0.3 else f"r{step}_{k}"
            states.setdefault(rid, RequestState(rid, [1, 2],
                                                SamplingParams(extra_args={"rid": rid}), None))
            batch.add_request(states[rid], [7] * rng.randint(0, 2), ([1],), 2)
        if batch.num_reqs:  # a token sampled for a random row
            row = rng.randrange(batch.num_reqs)
            batch.write_tokens(row, int(batch.num_tokens[row]), [step])
        procs.begin_step(batch, states)
        assert seen == dict(enumerate(batch.req_ids))
        outputs = procs.processors[0].outputs
        for row in range(batch.num_reqs):
            start, end = batch.num_prompt_tokens[row], batch.num_tokens[row]
            assert outputs[row] == batch.token_ids[row, start:end].tolist()


def test_rows_that_do_not_sample_are_placed_in_batch_rows():
    """Sampling rows [1, 3] of a 4-row batch: the processor sees a [4, V] tensor with them
    at rows 1 and 3 (zeros elsewhere) and its edits come back in sampling order."""
    class AddRow(LogitsProcessor):
        def __init__(self, config, device, is_pin_memory) -> None:
            pass

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            self.seen = logits.clone()
            return logits + torch.arange(logits.shape[0]).unsqueeze(1)

    procs = RunnerLogitsProcessors([AddRow], None, torch.device("cpu"))
    batch = InputBatch(4, [FULL])
    for i in range(4):
        batch.add_request(RequestState(f"r{i}", [1], SamplingParams(), None), [], ([1],), 0)
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = procs.for_rows(batch, np.array([1, 3])).apply(logits, argmax_invariant=False)
    assert procs.processors[0].seen.tolist() == [[0, 0], [1, 2], [0, 0], [3, 4]]
    assert out.tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert procs.for_rows(batch, np.array([1])).apply(logits, argmax_invariant=True) is logits
