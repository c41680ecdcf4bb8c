"""Mixture-of-experts: routing, token-to-expert grouping and the grouped expert GEMMs.

The plain-PyTorch references below define the results; the Triton kernels beside them
compute the same on the device with no host synchronisation (so they run in CUDA graphs).

Layout of the stacked expert weights (what the model layer holds):
- `w13`: `[num_experts, 2 * inter, hidden]`, each expert's gate rows then its up rows
  (`[gate | up]`, as `SiluAndMul` reads them);
- `w2`: `[num_experts, hidden, inter]`, each expert's down projection.

Routing weights are float32. An expert's output is computed in the activation dtype,
scaled by its routing weight and summed over a token's `top_k` experts in float32, then
rounded once to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_moe_ref", "route_ref"]


def route_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), the `top_k` largest, optionally renormalised
    to sum to 1.

    Ties are broken towards the lower expert id.

    Args:
        router_logits: `[num_tokens, num_experts]`, any float dtype.
        top_k: Experts per token.
        renormalize: Divide the chosen weights by their sum (Mixtral; Qwen3-MoE's
            `norm_topk_prob`).

    Returns:
        `(topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int32)`,
        each row in descending weight order.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])` for every token `t`,
    where `expert_e(x) = (silu(x @ gate_e.T) * (x @ up_e.T)) @ w2[e].T`.

    Args:
        hidden: `[num_tokens, hidden]`.
        w13: `[num_experts, 2 * inter, hidden]`, same dtype as `hidden`.
        w2: `[num_experts, hidden, inter]`, same dtype as `hidden`.
        topk_weights: `[num_tokens, top_k]` float32.
        topk_ids: `[num_tokens, top_k]` int32 / int64.

    Returns:
        `[num_tokens, hidden]` in `hidden`'s dtype.
    """
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[-1]
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1).long()
    for expert in torch.unique(flat_ids).tolist():
        slots = torch.nonzero(flat_ids == expert).squeeze(-1)  # token * top_k + j
        tokens = slots // top_k
        x = hidden[tokens]
        gate_up = x @ w13[expert].t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[expert].t()
        weight = topk_weights.reshape(-1)[slots].unsqueeze(-1)
        out.index_add_(0, tokens, y.float() * weight)
    return out.to(hidden.dtype)
