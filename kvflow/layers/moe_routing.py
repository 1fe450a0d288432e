"""MoE routing: which experts each token goes to, with what weight, and which experts a rank
holds.

The routing rules (from the HF configs):

* Mixtral: ``softmax(top_k(logits))`` -- computed as softmax over all experts, top-k, then
  renormalized to sum to 1, which is the same thing.
* Qwen2-MoE / Qwen3-MoE: softmax over all experts, top-k, and renormalized only when the
  config's ``norm_topk_prob`` is true (Qwen1.5-MoE: false; Qwen3-30B-A3B: true).
* DeepSeek-V2/V3 (:class:`GroupedTopKRouting`): experts are split into groups and a token may
  only pick experts in its best ``topk_group`` groups; V3 scores with a sigmoid plus a per-expert
  load-balancing bias that decides the choice but not the weight ("noaux_tc"), and the weights
  are scaled by ``routed_scaling_factor``.

Expert parallelism places whole experts by id (:func:`expert_range`). The experts themselves
run in :class:`kvflow.layers.moe.FusedMoE`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """The global expert ids ``[start, end)`` that EP rank ``ep_rank`` of ``ep_size`` holds.

    Raises:
        ValueError: if ``num_experts`` is not divisible by ``ep_size``.
    """
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be placed evenly on {ep_size} "
                         "expert-parallel ranks")
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing.

    Args:
        router_logits: [T, E] router scores (any float dtype).
        top_k: experts per token.
        renormalize: rescale the k kept probabilities to sum to 1 (Mixtral always; Qwen MoE
            when ``norm_topk_prob``).

    Returns:
        (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64), highest weight first.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class GroupedTopKRouting:
    """DeepSeek's routing rules, as its reference code and transformers apply them.

    ``topk_method``:

    * ``"greedy"``: top-k of the scores.
    * ``"group_limited_greedy"`` (DeepSeek-V2, arXiv:2405.04434, sec. 2.2.2 "device-limited
      routing"): the ``E`` experts form ``num_expert_group`` equal groups, a group's score is
      its best expert's score, only the ``topk_group`` best groups stay eligible (the others'
      scores become 0), then top-k.
    * ``"noaux_tc"`` (DeepSeek-V3, arXiv:2412.19437, sec. 2.1.2 "auxiliary-loss-free load
      balancing"): experts are chosen by ``score + e_score_correction_bias``; a group's score is
      the sum of its two best biased scores, the ``topk_group`` best groups stay eligible, top-k
      of the biased scores picks the experts, and their weights are the unbiased scores.

    Then the k weights are divided by their sum when ``renormalize`` (plus 1e-20), and
    multiplied by ``routed_scaling_factor``.

    Attributes:
        top_k: experts per token.
        scoring_func: ``"softmax"`` (V2) or ``"sigmoid"`` (V3) over the router logits, in fp32.
        topk_method: see above.
        num_expert_group / topk_group: groups, and groups kept per token (grouped methods).
        renormalize: rescale the k weights to sum to 1.
        routed_scaling_factor: multiplies the k weights.
    """

    top_k: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    num_expert_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        """Check the rule names and, for the grouped methods, the group counts.

        Raises:
            ValueError: for an unknown ``scoring_func`` or ``topk_method``, or (grouped
                methods) ``topk_group`` outside ``[1, num_expert_group]``.
        """
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring_func {self.scoring_func!r}: kvflow "
                             "supports softmax and sigmoid")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported MoE topk_method {self.topk_method!r}: kvflow "
                             "supports greedy, group_limited_greedy and noaux_tc")
        if self.grouped and not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError(f"MoE topk_group={self.topk_group} must be between 1 and "
                             f"n_group={self.num_expert_group} (the routing groups a token "
                             f"may use, {self.topk_method})")

    @property
    def grouped(self) -> bool:
        """Whether the method limits each token to its best groups (greedy ignores them)."""
        return self.topk_method != "greedy"

    def check_experts(self, num_experts: int) -> None:
        """Check the rule against a layer of ``num_experts`` experts.

        Raises:
            ValueError: if the experts do not form ``num_expert_group`` equal groups, or
                noaux_tc's groups (each scored by its two best experts) hold fewer than two.
        """
        if num_experts % self.num_expert_group:
            raise ValueError(f"{num_experts} experts cannot form n_group="
                             f"{self.num_expert_group} equal routing groups")
        if self.topk_method == "noaux_tc" and num_experts // self.num_expert_group < 2:
            raise ValueError(f"noaux_tc scores a routing group by its two best experts: "
                             f"n_group={self.num_expert_group} leaves "
                             f"{num_experts // self.num_expert_group} of the {num_experts} "
                             "experts per group")

    @property
    def uses_correction_bias(self) -> bool:
        """Whether the routing reads ``e_score_correction_bias`` (noaux_tc)."""
        return self.topk_method == "noaux_tc"

    def select(self, router_logits: torch.Tensor,
               e_score_correction_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] (any float dtype), e_score_correction_bias [E] float32 (for
        noaux_tc) -> (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)."""
        logits = router_logits.float()
        scores = logits.softmax(dim=-1) if self.scoring_func == "softmax" else logits.sigmoid()
        if self.topk_method == "greedy":
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
        elif self.topk_method == "group_limited_greedy":
            group_scores = self._grouped(scores).max(dim=-1).values
            eligible = self._group_mask(group_scores, scores.shape[-1])
            weights, ids = torch.topk(scores.masked_fill(~eligible, 0.0), self.top_k, dim=-1)
        else:
            choice = scores + e_score_correction_bias.float()
            group_scores = self._grouped(choice).topk(2, dim=-1).values.sum(dim=-1)
            eligible = self._group_mask(group_scores, scores.shape[-1])
            ids = torch.topk(choice.masked_fill(~eligible, float("-inf")), self.top_k,
                             dim=-1).indices
            weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def _grouped(self, scores: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, num_expert_group, E / num_expert_group]."""
        return scores.view(scores.shape[0], self.num_expert_group, -1)

    def _group_mask(self, group_scores: torch.Tensor, num_experts: int) -> torch.Tensor:
        """bool [T, E]: experts of each token's ``topk_group`` best groups."""
        best = torch.topk(group_scores, self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return keep.repeat_interleave(num_experts // self.num_expert_group, dim=1)
