"""EAGLE's feature stash stays bounded: the target's hidden states kept per request never
exceed the k + 1 rows of a verification step, over a long prompt read in chunks and a long
generation whose drafting adaptive lengths turn off and on; slots are freed when requests
leave the batch.

Oracles: hand-computed row counts per step (a prompt chunk whose next token is known keeps 1
row, its last, read again when the prompt's last token is computed alone with drafts after it;
the prompt's last chunk 1, a decode without drafts 1, a verification 1 + its drafts);
greedy output equals the plain engine's; with drafting every step, every draft equals a
plain-torch EAGLE-1 head's over transformers' hidden states (test_eagle_engine.py's
reference), so the head's K/V of a prompt read chunk by chunk is the whole prompt's.
"""

from __future__ import annotations

import pytest

from kvflow import SamplingParams
from kvflow.spec_decode.eagle import EagleDrafter
from kvflow.spec_decode.speculator import Speculator
from tests.spec_decode.test_eagle_engine import (
    _engine,
    _record_proposals,
    _ref_drafts,
    _save_mimic_head,
)
from tests.spec_decode.test_ngram_engine import _drafted, _same_outputs

K = 3
LONG_PROMPTS = [[(7 * i + 3) % 200 + 5 for i in range(150)],
                [(11 * i + 1) % 180 + 9 for i in range(97)]]


@pytest.fixture(scope="module")
def mimic(tiny_model_factory, tmp_path_factory):
    """(one-layer target, folder of its near-right EAGLE head, the head's tensors)."""
    target = tiny_model_factory("llama_1layer")
    folder = str(tmp_path_factory.mktemp("eagle_stash"))
    return target, folder, _save_mimic_head(folder, target)


def _spy_rows(monkeypatch) -> list[tuple[str, str, int, int]]:
    """Wrap observe_target: after each step, (request, kind of its step, rows kept,
    rows expected by hand) for every scheduled request; and check the slots held are the
    batch's requests."""
    seen: list[tuple[str, str, int, int]] = []
    original = EagleDrafter.observe_target

    def spy(self, batch, inputs, hidden, *args, **kwargs):
        steps = []
        for i, row in enumerate(inputs.rows.tolist()):
            q = int(inputs.query_start[i + 1] - inputs.query_start[i])
            c, n = int(batch.num_computed_tokens[row]), int(batch.num_tokens[row])
            if c + q > n:  # verifies c + q - n drafts: their rows and the bonus position's
                steps.append((batch.req_ids[row], "verify", q))
            elif q > 1 and c + q < n:  # a prompt chunk, next token known: all read now,
                steps.append((batch.req_ids[row], "chunk", 1))  # its last row kept
            elif q > 1:  # the prompt's last chunk: its last row waits for the next token
                steps.append((batch.req_ids[row], "last chunk", 1))
            else:  # a decode without drafts: the row drafting would resume from
                steps.append((batch.req_ids[row], "decode", 1))
        original(self, batch, inputs, hidden, *args, **kwargs)
        kept = self.stash.rows_kept()
        assert set(kept) == set(batch.req_id_to_index)
        seen.extend((rid, kind, kept[rid], want) for rid, kind, want in steps)

    monkeypatch.setattr(EagleDrafter, "observe_target", spy)
    return seen


def _drafting_off_every_other_window(monkeypatch, window: int = 6) -> None:
    """Adaptive lengths, as forced here: no drafts during every other ``window`` steps."""
    original = Speculator._lengths
    calls = [0]

    def lengths(self, candidates, drafts, num_base_tokens):
        calls[0] += 1
        chosen = original(self, candidates, drafts, num_base_tokens)
        return chosen * 0 if (calls[0] // window) % 2 else chosen

    monkeypatch.setattr(Speculator, "_lengths", lengths)


def test_rows_stay_bounded_over_long_prompts_and_generations(mimic, monkeypatch,
                                                             assert_no_leaks):
    target, folder, _ = mimic
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    base = _engine(target.path, None, num_kv_blocks=160, max_num_batched_tokens=32)
    ref = base.generate(LONG_PROMPTS, params, use_tqdm=False)
    spec = _engine(target.path, folder, k=K, num_kv_blocks=160, max_num_batched_tokens=32)
    seen = _spy_rows(monkeypatch)
    _drafting_off_every_other_window(monkeypatch)
    got = spec.generate(LONG_PROMPTS, params, use_tqdm=False)
    _same_outputs(ref, got)
    kinds = {kind for _, kind, _, _ in seen}
    assert kinds == {"chunk", "last chunk", "verify", "decode"}
    for rid, kind, kept, want in seen:
        assert kept == want, (rid, kind)
    assert max(kept for _, _, kept, _ in seen) == K + 1  # a full verification
    drafted, accepted = _drafted(got)
    assert drafted > 0 and accepted > 0
    stash = spec.engine.core.executor.runner.drafter.stash
    assert stash.buffer.shape[:2] == (4, K + 1)  # 4 slots: the smallest size, 2 requests
    spec.generate(LONG_PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(stash.slot) == 1  # the earlier requests' slots freed at the next step
    assert_no_leaks(spec)


def test_drafts_after_a_chunked_prompt_match_the_reference_head(mimic, monkeypatch):
    """Drafting every step: each draft is the plain-torch head's over the whole context,
    the prompt read by the head in the chunks the target computed."""
    target, folder, head = mimic
    spec = _engine(target.path, folder, k=K, num_kv_blocks=160, max_num_batched_tokens=32)
    proposals = _record_proposals(monkeypatch)
    spec.generate(LONG_PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                  use_tqdm=False)
    assert len(proposals) >= 4
    for context, drafts, _ in proposals:
        assert drafts == _ref_drafts(target.hf_model, head, context, len(drafts))


def test_preempted_requests_free_their_slots(mimic, monkeypatch, assert_no_leaks):
    """Recompute preemption: the slots held are always the batch's requests (checked in
    the spy) and the output is the plain engine's."""
    target, folder, _ = mimic
    prompts = [p[:40 + 9 * i] for i, p in enumerate(LONG_PROMPTS * 3)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _engine(target.path, None).generate(prompts, params, use_tqdm=False)
    spec = _engine(target.path, folder, k=K, num_kv_blocks=60, max_num_seqs=6)
    seen = _spy_rows(monkeypatch)
    got = spec.generate(prompts, params, use_tqdm=False)
    _same_outputs(ref, got)
    assert spec.engine.core.scheduler.num_preemptions > 0
    for rid, kind, kept, want in seen:
        assert kept == want, (rid, kind)
    assert_no_leaks(spec)
