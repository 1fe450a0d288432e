"""The rejection sampler keeps the target distribution exactly (Leviathan et al. 2023,
Chen et al. 2023), whatever the draft: chi-square tests on a small vocabulary against the
target's own probabilities, with deliberately bad drafts; greedy rows against the argmax rule
worked by hand.
"""

from __future__ import annotations

import torch

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


def test_seeded_requests_draw_from_their_own_generator():
    """A seeded request's tokens do not depend on its batch neighbours or the engine's
    generator."""
    base = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=base)
    q = _bad_draft(base)
    drafts = torch.tensor([[int(q.argmax())]])

    def run(batch_logits: torch.Tensor, num_reqs: int, row: int, engine_seed: int) -> list:
        layout = SpecLayout(torch.arange(num_reqs) * 2, torch.ones(num_reqs, dtype=torch.int64),
                            drafts.expand(num_reqs, 1).contiguous(),
                            q.expand(num_reqs, 1, V).contiguous(),
                            {row: torch.Generator().manual_seed(42)})
        out = rejection_sample(batch_logits, torch.ones(2 * num_reqs), None, None, None, layout,
                               torch.Generator().manual_seed(engine_seed))
        return out.token_ids[row].tolist()

    alone = run(logits, 1, 0, 0)
    noise = torch.randn(4, V, generator=base)
    crowded = run(torch.cat([noise, logits]), 3, 2, 1)  # the request's rows come last
    assert alone == crowded


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
