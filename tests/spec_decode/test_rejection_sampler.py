"""The rejection sampler keeps the target distribution exactly (Leviathan et al. 2023,
Chen et al. 2023), whatever the draft: chi-square tests on a small vocabulary against the
target's own probabilities, with deliberately bad drafts; greedy rows against the argmax rule
worked by hand.
"""

from __future__ import annotations

import torch

from kvflow.layers.sampler import Sampler
from kvflow.layers.sampling_metadata import SamplingMetadata
from kvflow.spec_decode.rejection_sampler import SpecLayout, rejection_sample

V = 8
N = 40_000  # independent requests per test


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (cells with p > 0)."""
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a token of probability 0 was emitted"
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         stat.double() / 2))


def assert_sampled_token_follows(outs: list, index: int, marginal: torch.Tensor) -> None:
    """Generated token ``index`` over the requests ``outs`` (RequestOutputs) is distributed as
    ``marginal`` ([vocab] probabilities): :func:`chi_square_p_value` > 0.001."""
    tokens = torch.tensor([o.outputs[0].token_ids[index] for o in outs])
    counts = torch.bincount(tokens, minlength=len(marginal)).double()
    assert chi_square_p_value(counts, marginal) > 1e-3


def _bad_draft(gen: torch.Generator) -> torch.Tensor:
    """A draft distribution far from the target: most mass on what the target finds rare."""
    return torch.softmax(3.0 * torch.randn(V, generator=gen), 0)


def _layout(num_reqs: int, k: int, drafts: torch.Tensor, q: torch.Tensor | None) -> SpecLayout:
    return SpecLayout(torch.arange(num_reqs) * (k + 1), torch.full((num_reqs,), k), drafts, q)


def test_every_emitted_position_follows_the_target_with_a_bad_draft():
    gen = torch.Generator().manual_seed(0)
    k = 2
    target_logits = torch.randn(k + 1, V, generator=gen)  # p_0, p_1, p_2 (context-free target)
    p = torch.softmax(target_logits, -1)
    q = torch.stack([_bad_draft(gen) for _ in range(k)])  # [k, V]
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen)
                          for i in range(k)], 1)  # [N, k], d_i ~ q_i
    out = rejection_sample(target_logits.repeat(N, 1), torch.ones(N * (k + 1)), None, None,
                           None, _layout(N, k, drafts, q.expand(N, k, V).contiguous()), gen)
    tokens, emitted = out.token_ids, out.num_emitted
    # position 0 is always emitted and is a sample of p_0
    assert chi_square_p_value(torch.bincount(tokens[:, 0], minlength=V).double(), p[0]) > 1e-3
    # given the first draft was accepted, position 1 is a sample of p_1; likewise position 2
    for pos in (1, 2):
        seen = tokens[emitted > pos, pos]
        assert len(seen) > 1000
        assert chi_square_p_value(torch.bincount(seen, minlength=V).double(), p[pos]) > 1e-3
    # rejections did happen at both drafts, and full acceptance (a bonus token) too
    assert set(emitted.tolist()) == {1, 2, 3}
    # the acceptance probability matches sum_x min(p_0(x), q_1(x))
    accept_rate = float((emitted > 1).double().mean())
    assert abs(accept_rate - float(torch.minimum(p[0], q[0]).sum())) < 0.01


def test_ngram_point_mass_drafts_keep_the_target_distribution():
    """A deterministic draft (q = 1 on it) is accepted with probability p(d) and otherwise
    replaced by a sample of p without d: the emitted token is still a sample of p."""
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(2, V, generator=gen)
    p = torch.softmax(target_logits[0], -1)
    drafts = torch.full((N, 1), int(p.argmin()))  # the worst possible guess
    out = rejection_sample(target_logits.repeat(N, 1), torch.ones(2 * N), None, None, None,
                           _layout(N, 1, drafts, None), gen)
    counts = torch.bincount(out.token_ids[:, 0], minlength=V).double()
    assert chi_square_p_value(counts, p) > 1e-3
    assert abs(float((out.num_emitted == 2).double().mean()) - float(p.min())) < 0.01


def test_temperature_and_top_k_top_p_shape_the_target():
    gen = torch.Generator().manual_seed(2)
    target_logits = torch.randn(2, V, generator=gen)
    temperature, top_k, top_p = 0.7, 4, 0.9
    scaled = target_logits[0] / temperature
    order = scaled.argsort(descending=True)
    kept = order[:top_k]
    probs = torch.softmax(scaled[kept], 0)
    mass_before = probs.cumsum(0) - probs
    kept = kept[mass_before < top_p]  # Holtzman's nucleus inside the top-k
    p = torch.zeros(V)
    p[kept] = torch.softmax(scaled[kept], 0)
    q = _bad_draft(gen)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen).unsqueeze(1)
    out = rejection_sample(target_logits.repeat(N, 1), torch.full((2 * N,), temperature),
                           torch.full((2 * N,), top_k), torch.full((2 * N,), top_p), None,
                           _layout(N, 1, drafts, q.expand(N, 1, V).contiguous()), gen)
    counts = torch.bincount(out.token_ids[:, 0], minlength=V).double()
    assert chi_square_p_value(counts, p) > 1e-3


def test_greedy_rows_follow_the_argmax_rule():
    """Worked by hand: request 0's argmaxes are 3, 5, 1 and its drafts 3, 2 -> accepts 3,
    then 5 replaces the wrong 2; request 1's drafts 4, 4 match argmaxes 4, 4 -> both accepted
    plus the bonus argmax 6; request 2 has no drafts -> its argmax 0."""
    logits = torch.full((7, V), -1.0)
    for row, best in enumerate([3, 5, 1, 4, 4, 6, 0]):
        logits[row, best] = 1.0
    layout = SpecLayout(torch.tensor([0, 3, 6]), torch.tensor([2, 2, 0]),
                        torch.tensor([[3, 2], [4, 4], [0, 0]]))
    out = rejection_sample(logits, torch.zeros(7), None, None, None, layout,
                           torch.Generator().manual_seed(0))
    assert out.num_emitted.tolist() == [2, 3, 1]
    assert out.token_ids.tolist() == [[3, 5, -1], [4, 4, 6], [0, -1, -1]]


def _plain_seeded(logits: torch.Tensor, seed: int, position: int) -> list[int]:
    """The plain sampler's seeded token of each row of ``logits`` [n, V] (temperature 1),
    row ``j`` at output position ``position + j``: the oracle seeded verification must
    reproduce."""
    sampler = Sampler(torch.Generator().manual_seed(12345))
    return [int(sampler(row.unsqueeze(0).clone(),
                        SamplingMetadata(torch.ones(1), seeded={0: (seed, position + j)})
                        ).sampled[0]) for j, row in enumerate(logits)]


def test_seeded_requests_emit_the_plain_seeded_tokens_whatever_the_drafts():
    """A seeded request's tokens are the plain sampler's seeded tokens at the same output
    positions, for any number of drafts (cut or not), right or wrong, any draft distribution,
    any neighbours and engine generator: with k drafts of which the first w equal the plain
    tokens, it emits the plain tokens 0..w (w + 1 of them; k + 1 when all are right). The old
    rule drew one uniform per verified draft from the request's generator, so a cut draft
    list shifted every later draw (and the accept test was p/q, not equality)."""
    base = torch.Generator().manual_seed(3)
    k = 3
    for seed in range(60):
        logits = torch.randn(k + 1, V, generator=base)
        plain = _plain_seeded(logits, seed, position=5)
        q = torch.stack([_bad_draft(base) for _ in range(k)])
        for num_drafts in range(k + 1):
            for wrong in range(num_drafts + 1):  # drafts 0..wrong-1 right, draft wrong not
                drafts = plain[:num_drafts]
                if wrong < num_drafts:
                    drafts = drafts[:wrong] + [(plain[wrong] + 1) % V] + drafts[wrong + 1:]
                emitted = min(wrong, num_drafts) + 1
                neighbours = torch.randn(2 * (k + 1), V, generator=base)
                rows = torch.cat([neighbours[:k + 1], logits[:num_drafts + 1],
                                  neighbours[k + 1:]])
                padded = torch.tensor([[1] * k, drafts + [0] * (k - num_drafts), [2] * k])
                layout = SpecLayout(torch.tensor([0, k + 1, k + 2 + num_drafts]),
                                    torch.tensor([k, num_drafts, k]), padded,
                                    torch.stack([q, q, q]), {1: (seed, 5)})
                out = rejection_sample(rows, torch.ones(len(rows)), None, None, None, layout,
                                       torch.Generator().manual_seed(seed + 1000))
                assert out.num_emitted[1] == emitted, (seed, num_drafts, wrong)
                assert out.token_ids[1, :emitted].tolist() == plain[:emitted]


def test_seeded_tokens_keep_the_target_distribution():
    """Over the seeds 0..N-1 (no random choice left: the test cannot flake), the seeded
    token at one position with a bad draft that is sometimes right follows the target's
    softmax (chi-square, p > 0.001), and so does the bonus token after an accepted draft."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, V, generator=gen)
    p = torch.softmax(logits, -1)
    num = 20_000
    drafts = torch.full((num, 1), int(p[0].argmin()))
    drafts[::3] = int(p[0].argmax())
    layout = SpecLayout(torch.arange(num) * 2, torch.ones(num, dtype=torch.int64), drafts,
                        seeded={r: (r, 0) for r in range(num)})
    out = rejection_sample(logits.repeat(num, 1), torch.ones(2 * num), None, None, None,
                           layout, gen)
    first = out.token_ids[:, 0]
    assert chi_square_p_value(torch.bincount(first, minlength=V).double(), p[0]) > 1e-3
    accepted = out.num_emitted == 2
    bonus = out.token_ids[accepted, 1]
    assert chi_square_p_value(torch.bincount(bonus, minlength=V).double(), p[1]) > 1e-3


def test_vanishing_temperature_and_top_p_are_the_argmax():
    """temperature 1e-45 (float32's smallest subnormal: the scaled logits overflowed to inf)
    and top_p 0 (what 1e-300 is in float32: every token was masked) made NaN target rows,
    whose drafts were all rejected and whose tokens were garbage. Both are the greedy limit:
    a draft of the argmax is accepted and the bonus token is the next row's argmax."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, V, generator=gen)
    best = logits.argmax(dim=-1).tolist()
    q = torch.zeros(N, 1, V)
    q[:, 0, best[0]] = 1.0
    drafts = torch.full((N, 1), best[0])
    for temperature, top_p in [(1e-45, 1.0), (1.0, 0.0)]:
        out = rejection_sample(logits.repeat(N, 1), torch.full((2 * N,), temperature), None,
                               torch.full((2 * N,), top_p), None,
                               _layout(N, 1, drafts, q), gen)
        assert out.num_emitted.tolist() == [2] * N, (temperature, top_p)
        assert out.token_ids.tolist() == [best] * N, (temperature, top_p)
