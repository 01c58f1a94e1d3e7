"""Mixture of experts: parameter counts of real models, routing, capacity, balance (chapter 05).

- :class:`MoEConfig` with :data:`MIXTRAL_8X7B` and :data:`DEEPSEEK_V3`, and
  :func:`count_params` → (total, active), counted tensor by tensor.
- :func:`topk_route`: top-k selection, tokens per expert, the capacity
  ``ceil(capacity_factor · tokens · k / experts)`` and which assignments overflow it.
- :func:`switch_balance_loss`: the Switch Transformer's ``E · Σ f_i π_i`` (Fedus et al.
  2021, who write N and P_i), 1 for a perfectly even router.
- :func:`bias_update` and :func:`group_limited_topk`: DeepSeek-V3's auxiliary-loss-free
  balancing and its group (node) limited routing.
- :class:`MoELayer`: router + SwiGLU experts (+ optional :class:`SharedExpert`), forward
  and backward, with tokens sorted and grouped by expert (:meth:`Route.assignments`, which
  expert parallelism shares); :meth:`MoELayer.forward_naive` is
  the per-token loop it is checked against, with routing of its own (its own top-k, its
  own capacity queues), so that a routing bug in the fast path shows as a difference.
- :func:`grouped_swiglu` and :meth:`MoELayer.forward_grouped`: the experts as a grouped GEMM
  (three products for all experts at once) instead of one product per expert: padded into one
  batched product, or ``torch.nn.functional.grouped_mm`` with per-expert offsets.
- :func:`router_z_loss`: ST-MoE's router z-loss, the mean over tokens of the squared
  logsumexp of the router logits (Zoph et al. 2022).
- :func:`sigmoid_route`: DeepSeek-V3's router: sigmoid affinities, the bias for the choice
  only, the chosen affinities normalised and scaled by the route scale, nothing dropped.
- :func:`gshard_top2_route`: GShard's top-2 rule in full, its second expert dispatched with
  probability 2·g2 (Lepikhin et al. 2021, Algorithm 1).
- :func:`balance_loss` and :func:`sequence_balance_loss`: ``E · Σ f_i π_i`` from any router's
  probabilities, with the counts of whatever scope (micro-batch, global batch) or within each
  sequence (DeepSeek-V3's sequence-wise loss).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .rules import check_like as _check_like, whole as _whole


# ---------------------------------------------------------------------------- configurations

@dataclass(frozen=True)
class MoEConfig:
    """A decoder-only MoE transformer, as its published configuration file describes it.

    ``attention`` is ``"gqa"`` (q, k, v, o projections with ``kv_heads`` key/value heads)
    or ``"mla"`` (DeepSeek's multi-head latent attention, with its low-rank sizes).
    Experts are SwiGLU MLPs (three matrices). The first ``dense_layers`` layers use a dense
    SwiGLU MLP of width ``ffn`` instead of experts.
    """

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    experts: int
    top_k: int
    moe_ffn: int
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn: int | None = None
    dense_layers: int = 0
    shared_experts: int = 0
    tied_embeddings: bool = False
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router_bias: bool = False           # DeepSeek-V3's per-expert selection bias
    groups: int = 1                     # expert groups for group-limited routing
    top_groups: int = 1
    source: str = ""


#: Mixtral 8x7B, from its transformers configuration (Jiang et al. 2024).
MIXTRAL_8X7B = MoEConfig(
    name="Mixtral 8x7B", vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
    experts=8, top_k=2, moe_ffn=14336, source="transformers configuration_mixtral.py (Mistral AI)")

#: DeepSeek-V3, from inference/configs/config_671B.json (DeepSeek-AI 2024).
DEEPSEEK_V3 = MoEConfig(
    name="DeepSeek-V3", vocab=129280, hidden=7168, layers=61, heads=128, experts=256, top_k=8,
    moe_ffn=2048, ffn=18432, dense_layers=3, shared_experts=1, attention="mla", q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, router_bias=True,
    groups=8, top_groups=4, source="DeepSeek-V3 inference/configs/config_671B.json")


def param_breakdown(c: MoEConfig) -> dict[str, tuple[int, int]]:
    """Parameters by part of the model, as (total, active per token)."""
    h = c.hidden
    if c.attention == "gqa":
        d = c.head_dim or h // c.heads
        kv = c.kv_heads or c.heads
        attn = h * c.heads * d + 2 * h * kv * d + c.heads * d * h                # q, k, v, o
    elif c.attention == "mla":
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        attn = (h * c.q_lora_rank + c.q_lora_rank                                 # wq_a, q_norm
                + c.q_lora_rank * c.heads * qk                                    # wq_b
                + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank      # wkv_a, kv_norm
                + c.kv_lora_rank * c.heads * (c.qk_nope_head_dim + c.v_head_dim)  # wkv_b
                + c.heads * c.v_head_dim * h)                                     # wo
    else:
        raise ValueError(f"attention must be 'gqa' or 'mla', got {c.attention!r}")
    expert = 3 * h * c.moe_ffn                                                    # SwiGLU: w1, w3 (h→f), w2 (f→h)
    moe_layers = c.layers - c.dense_layers
    router = h * c.experts + (c.experts if c.router_bias else 0)
    parts = {
        "embedding": (c.vocab * h, c.vocab * h),
        "attention": (c.layers * attn, c.layers * attn),
        "norms": (c.layers * 2 * h + h, c.layers * 2 * h + h),                    # two per layer + final
        "dense MLPs": (c.dense_layers * 3 * h * (c.ffn or 0),) * 2,
        "routed experts": (moe_layers * c.experts * expert, moe_layers * c.top_k * expert),
        "shared experts": (moe_layers * c.shared_experts * expert,) * 2,
        "routers": (moe_layers * router,) * 2,
        "output head": (0, 0) if c.tied_embeddings else (c.vocab * h, c.vocab * h),
    }
    return parts


def count_params(config: MoEConfig) -> tuple[int, int]:
    """``(total, active)``: every parameter, and those one token's forward pass uses."""
    parts = param_breakdown(config)
    return sum(t for t, _ in parts.values()), sum(a for _, a in parts.values())


# ---------------------------------------------------------------------------- routing

def capacity(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """Assignments one expert accepts: ``ceil(capacity_factor · tokens · k / experts)``.

    Switch Transformer's tokens/experts × factor (Fedus et al. 2021), with k assignments
    per token and rounded up as Megatron-Core's ``get_capacity`` does (Mesh TensorFlow, and
    the course's opening example, round down: the two differ only when the product is not
    whole). The ``- 1e-9`` keeps a whole product computed a hair too high (1.1 · 100 · 1 / 10
    is 11.000000000000002 in floating point) from rounding up to the next number.
    """
    if not (isinstance(capacity_factor, (int, float)) and 0 < capacity_factor < math.inf):
        raise ValueError(f"capacity factor must be a finite number > 0, got {capacity_factor!r}")
    return math.ceil(capacity_factor * tokens * k / experts - 1e-9)


@dataclass
class Route:
    """What the router decided for a batch of tokens."""

    expert_index: torch.Tensor    # (tokens, k): chosen experts, best first
    weights: torch.Tensor         # (tokens, k): combine weights (softmax over the chosen k)
    kept: torch.Tensor            # (tokens, k): False where the expert was already full
    counts: torch.Tensor          # (experts,): assignments before dropping
    capacity: int
    probs: torch.Tensor           # (tokens, experts): the router's softmax

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())

    @property
    def kept_counts(self) -> torch.Tensor:
        return torch.bincount(self.expert_index[self.kept], minlength=self.counts.numel())

    def assignments(self, by_expert: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept assignments as ``(token, expert, weight)``, each ``(A,)``: grouped by expert
        (a stable sort, so in token order within an expert), or with ``by_expert=False`` in
        token order, a token's choices best first."""
        T, k = self.expert_index.shape
        token = torch.arange(T, device=self.expert_index.device).unsqueeze(1).expand(T, k)[self.kept]
        expert, weight = self.expert_index[self.kept], self.weights[self.kept]
        if by_expert:
            order = torch.argsort(expert, stable=True)
            token, expert, weight = token[order], expert[order], weight[order]
        return token, expert, weight


def topk_route(logits: torch.Tensor, k: int, capacity_factor: float, bias: torch.Tensor | None = None,
               groups: int = 1, top_groups: int | None = None) -> Route:
    """Top-k routing with a capacity per expert.

    ``logits`` is ``(tokens, experts)``. Each token picks its ``k`` highest scores (with
    ``bias`` added for the choice only, as in DeepSeek-V3); its combine weights are the
    softmax of its chosen logits. Assignments beyond an expert's capacity are dropped:
    first choices of all tokens have priority over second choices, and within a rank of
    choice earlier tokens come first (GShard's order, Lepikhin et al. 2021). With
    ``groups`` > 1 the experts form that many equal groups (nodes) and each token chooses
    within its ``top_groups`` best groups (:func:`group_limited_topk`).
    """
    logits = torch.as_tensor(logits)
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point (tokens, experts) matrix, got shape "
                         f"{tuple(logits.shape)} and dtype {logits.dtype}")
    if logits.device.type == "meta":
        raise ValueError("topk_route: logits are on meta (shapes only); routing needs their values on a real device")
    T, E = logits.shape
    _check_bias(bias, logits, "topk_route")
    _whole(k, "k (experts per token)")
    if k > E:
        raise ValueError(f"k={k} experts per token is more than the {E} experts")
    cap = capacity(T, E, k, capacity_factor)
    if groups == 1:
        choose = logits if bias is None else logits + bias
        expert_index = choose.topk(k, dim=-1).indices                            # (T, k)
    else:
        expert_index = group_limited_topk(logits, k, groups, groups if top_groups is None else top_groups, bias)
    weights = torch.softmax(logits.gather(-1, expert_index), dim=-1)             # (T, k)
    counts = torch.bincount(expert_index.flatten(), minlength=E)
    # Position of each assignment in its expert's queue: choice rank first, then token order.
    order = expert_index.T.reshape(-1)                                           # (k·T,), choice-major
    onehot = F.one_hot(order, E)                                                 # (k·T, E)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)                         # 0, 1, 2 … per expert
    kept = (position < cap).reshape(k, T).T                                      # (T, k)
    return Route(expert_index, weights, kept, counts, cap, torch.softmax(logits, dim=-1))


def _check_bias(bias, logits: torch.Tensor, who: str) -> None:
    """The selection bias must be one floating-point number per expert, on the logits' device."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (logits.shape[1],):
        got = (f"shape {tuple(bias.shape)} and dtype {bias.dtype}" if isinstance(bias, torch.Tensor)
               else type(bias).__name__)
        raise ValueError(f"{who}: bias must be a floating-point ({logits.shape[1]},) tensor, one number per "
                         f"expert, got {got}")
    if bias.device != logits.device:
        raise ValueError(f"{who}: bias is on {bias.device} but the router's logits are on {logits.device}")


def check_tokens(x, hidden: int, weight: torch.Tensor, who: str, what: str = "tokens",
                 weight_name: str = "the router weight") -> None:
    """``ValueError`` unless ``x`` is a floating-point ``(T, hidden)`` tensor on ``weight``'s dtype and device."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2 or x.shape[1] != hidden:
        got = (f"shape {tuple(x.shape)} and dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__)
        raise ValueError(f"{who} expects {what} x as a floating-point (T, {hidden}) tensor, got {got}")
    _check_like(x, "x", weight, weight_name, who)


def switch_balance_loss(logits: torch.Tensor, expert_index: torch.Tensor) -> torch.Tensor:
    """``E · Σ_i f_i · π_i`` (Fedus et al. 2021, who write N and P_i): f_i the fraction of
    assignments routed to expert i, π_i the router's mean probability for it. 1 when both
    are uniform; it grows as the router concentrates. Differentiable in ``logits`` (through
    π only: f comes from a discrete choice).
    """
    logits = torch.as_tensor(logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be a (tokens, experts) matrix, got shape {tuple(logits.shape)}")
    E = logits.shape[-1]
    f = torch.bincount(torch.as_tensor(expert_index).flatten(), minlength=E).to(logits.dtype)
    f = f / f.sum()
    pi = torch.softmax(logits, dim=-1).mean(0)                                   # (E,): π_i
    return E * (f * pi).sum()


def bias_update(bias: torch.Tensor, counts: torch.Tensor, gamma: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing: lower an overloaded expert's bias by γ,
    raise an underloaded one's by γ (load compared with the mean)."""
    counts = torch.as_tensor(counts, dtype=torch.float32)
    return bias - gamma * torch.sign(counts - counts.mean()).to(bias.dtype)


def group_limited_topk(scores: torch.Tensor, k: int, groups: int, top_groups: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V3's group-limited choice: experts are split into ``groups`` equal groups
    (one per node, say); each token keeps the ``top_groups`` groups whose two best
    (biased) scores add up highest, then takes its top-k experts within them.
    Returns the (tokens, k) expert indices.
    """
    T, E = scores.shape
    _check_groups(E, k, groups, top_groups)
    choose = scores if bias is None else scores + bias
    per_group = choose.view(T, groups, E // groups)                              # (T, G, E/G)
    group_score = per_group.topk(min(2, E // groups), dim=-1).values.sum(-1)     # (T, G)
    keep = group_score.topk(top_groups, dim=-1).indices                          # (T, top_groups)
    mask = torch.zeros(T, groups, dtype=torch.bool, device=scores.device).scatter_(1, keep, True)
    masked = choose.masked_fill(~mask.repeat_interleave(E // groups, dim=1), float("-inf"))
    return masked.topk(k, dim=-1).indices


def _check_groups(E: int, k: int, groups: int, top_groups: int) -> None:
    """Group-limited routing needs equal groups and enough experts in the groups kept."""
    _whole(groups, "groups")
    _whole(k, "k (experts per token)")
    _whole(top_groups, "top_groups")
    if E % groups:
        raise ValueError(f"{E} experts do not split into {groups} equal groups")
    if not 1 <= top_groups <= groups:
        raise ValueError(f"top_groups={top_groups} must lie between 1 and groups={groups}")
    if k > top_groups * (E // groups):
        raise ValueError(f"k={k} experts cannot come from {top_groups} groups of {E // groups}")


# ---------------------------------------------------------------------------- more routers and losses

def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over tokens of the square of
    ``logsumexp`` of each token's router logits, ``(1/T) Σ_t (log Σ_i exp z_ti)²``.

    It is 0 only where every token's logsumexp is 0 and grows with the logits' size: it
    pushes the logits towards small magnitudes, where rounding (bfloat16's 8 significant
    bits) costs least, without changing the router's probabilities first — softmax ignores a
    shift common to a token's logits, the z-loss does not. ST-MoE weights it by 1e-3;
    Megatron-Core's ``moe_z_loss_coeff`` applies the same mean (``z_loss_func``).
    Differentiable in ``logits``.
    """
    logits = torch.as_tensor(logits)
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"router_z_loss: logits must be a floating-point (tokens, experts) matrix, got shape "
                         f"{tuple(logits.shape)} and dtype {logits.dtype}")
    return torch.logsumexp(logits, dim=-1).square().mean()


def sigmoid_route(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None, route_scale: float = 1.0,
                  groups: int = 1, top_groups: int | None = None) -> Route:
    """DeepSeek-V3's router (its ``inference/model.py`` ``Gate``; the technical report's eq. 13–16).

    Affinities ``s = sigmoid(logits)``, each in (0, 1) and independent of the other experts'.
    Each token takes the ``k`` experts with the highest ``s + bias`` (the bias for the choice
    only), within its ``top_groups`` best groups when ``groups`` > 1 (:func:`group_limited_topk`,
    on the biased affinities); its combine weights are its chosen, unbiased ``s`` normalised
    to sum 1, times ``route_scale`` (2.5 in DeepSeek-V3's ``config_671B.json``). Nothing is
    dropped: ``kept`` is all True and ``capacity`` is ``T``, the most assignments one expert
    can receive. ``probs`` is ``s`` normalised over all experts, the ``s'`` whose mean
    DeepSeek-V3's sequence-wise balance loss uses (eq. 19–20).
    """
    logits = torch.as_tensor(logits)
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"sigmoid_route: logits must be a floating-point (tokens, experts) matrix, got shape "
                         f"{tuple(logits.shape)} and dtype {logits.dtype}")
    T, E = logits.shape
    _check_bias(bias, logits, "sigmoid_route")
    _whole(k, "k (experts per token)")
    if k > E:
        raise ValueError(f"k={k} experts per token is more than the {E} experts")
    if not (isinstance(route_scale, (int, float)) and not isinstance(route_scale, bool)
            and 0 < route_scale < math.inf):
        raise ValueError(f"sigmoid_route: route_scale must be a finite number > 0, got {route_scale!r}")
    scores = torch.sigmoid(logits)                                               # (T, E), in (0, 1)
    if groups == 1:
        expert_index = (scores if bias is None else scores + bias).topk(k, dim=-1).indices
    else:
        expert_index = group_limited_topk(scores, k, groups, groups if top_groups is None else top_groups, bias)
    chosen = scores.gather(-1, expert_index)                                     # (T, k), unbiased
    weights = chosen / chosen.sum(-1, keepdim=True) * route_scale
    counts = torch.bincount(expert_index.flatten(), minlength=E)
    kept = torch.ones_like(expert_index, dtype=torch.bool)
    return Route(expert_index, weights, kept, counts, T, scores / scores.sum(-1, keepdim=True))


def gshard_top2_route(logits: torch.Tensor, capacity_factor: float,
                      generator: torch.Generator | None = None,
                      declined_take_a_slot: bool = False) -> tuple[Route, torch.Tensor]:
    """GShard's top-2 gating with its random second expert (Lepikhin et al. 2021, Algorithm 1,
    one group).

    Gates ``g = softmax(logits)``; each token's two best, normalised over the two:
    ``g1/(g1+g2)`` and ``g2/(g1+g2)`` (the softmax of the two chosen logits, as
    :func:`topk_route` computes). The first choice is always dispatched; the second only when
    ``2·g2 > rnd``, ``rnd`` uniform in [0, 1) — with probability ``2·g2`` (≤ 1, since g2 ≤ ½),
    "proportional to its weight". The queues are served as in :func:`topk_route`: every
    first choice in token order, then the second choices; an expert takes at most
    ``capacity(T, E, 2, capacity_factor)``.

    Where the two rules differ is a second choice the draw turns down. By default it takes no
    place in its expert's queue: the slot stays free for a later token. Algorithm 1 as printed
    advances the expert's counter (the paper's ``c_e2``) for every second choice, dispatched or
    not, so there a declined second choice still uses up a place; ``declined_take_a_slot=True``
    follows the printed algorithm. With the same ``generator`` both draw the same ``rnd``.

    Returns ``(route, sampled)``: ``route.kept`` is dispatched *and* within capacity, so
    ``route.dropped`` counts both the draw's refusals and capacity's; ``sampled`` (T,) says
    which second choices the draw kept; ``route.counts`` counts the dispatched assignments.
    GShard's balance statistic counts first choices only:
    ``balance_loss(route.probs, torch.bincount(route.expert_index[:, 0], minlength=E))``.
    """
    logits = torch.as_tensor(logits)
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"gshard_top2_route: logits must be a floating-point (tokens, experts) matrix, got shape "
                         f"{tuple(logits.shape)} and dtype {logits.dtype}")
    T, E = logits.shape
    if E < 2:
        raise ValueError(f"gshard_top2_route needs at least 2 experts, got {E}")
    if not isinstance(declined_take_a_slot, bool):
        raise ValueError(f"gshard_top2_route: declined_take_a_slot must be True or False, got {declined_take_a_slot!r}")
    cap = capacity(T, E, 2, capacity_factor)
    gates = torch.softmax(logits, dim=-1)                                        # (T, E)
    top = gates.topk(2, dim=-1)
    expert_index = top.indices                                                   # (T, 2)
    weights = top.values / top.values.sum(-1, keepdim=True)                      # g1, g2 normalised
    rnd = torch.rand(T, generator=generator, dtype=torch.float64).to(weights.device)
    sampled = 2 * weights[:, 1].detach().double() > rnd                          # (T,)
    wanted = torch.stack([torch.ones_like(sampled), sampled], dim=1)             # (T, 2)
    queued = torch.ones_like(wanted) if declined_take_a_slot else wanted         # who advances a counter
    order = expert_index.T.reshape(-1)                                           # choice-major
    onehot = F.one_hot(order, E) * queued.T.reshape(-1, 1)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)
    kept = (wanted.T.reshape(-1) & (position < cap)).reshape(2, T).T
    counts = torch.bincount(expert_index[wanted], minlength=E)                   # dispatched, before capacity
    return Route(expert_index, weights, kept, counts, cap, gates), sampled


def balance_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``E · Σ_i f_i · π_i`` from a router's probabilities ``probs`` (T, E) and assignment
    counts per expert ``counts`` (E,): ``f_i = counts_i / Σ counts``, ``π_i`` the mean of
    ``probs[:, i]`` over the T tokens. 1 when both are uniform.

    The counts set the scope. This micro-batch's (``torch.bincount`` of its routing) gives
    :func:`switch_balance_loss` — Megatron-Core's ``"aux_loss"``. Counts from more tokens than
    ``probs`` covers balance a wider scope: Megatron-Core's ``"global_aux_loss"`` passes, for the
    j-th micro-batch of a step, the counts summed over its tensor-, data- and context-parallel
    ranks and averaged over micro-batches 1 … j so far (a running mean, reset every step), with
    this micro-batch's ``probs``; only the step's last micro-batch sees the whole global batch's
    counts (scaling the counts does not change ``f``). ``probs`` is the router's softmax, or for a
    sigmoid router its affinities normalised per token (DeepSeek-V3's ``s'``,
    :attr:`Route.probs` of :func:`sigmoid_route`). Differentiable in ``probs``.
    """
    probs = torch.as_tensor(probs)
    counts = torch.as_tensor(counts)
    if probs.dim() != 2 or not probs.is_floating_point():
        raise ValueError(f"balance_loss: probs must be a floating-point (tokens, experts) matrix, got shape "
                         f"{tuple(probs.shape)} and dtype {probs.dtype}")
    E = probs.shape[1]
    if tuple(counts.shape) != (E,) or bool((counts < 0).any()):
        raise ValueError(f"balance_loss: counts must be ({E},), one count ≥ 0 per expert, got shape "
                         f"{tuple(counts.shape)}")
    f = counts.to(probs.dtype) / counts.sum().to(probs.dtype)
    return E * (f * probs.mean(0)).sum()


def sequence_balance_loss(probs: torch.Tensor, expert_index: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The balance loss within each sequence, averaged over the sequences: DeepSeek-V3's
    complementary sequence-wise balance loss (eq. 17–20, without its weight α) and
    Megatron-Core's ``"seq_aux_loss"``.

    ``probs`` (T, E) and ``expert_index`` (T, k) hold T/``seq_len`` sequences of ``seq_len``
    consecutive tokens; each sequence's ``E · Σ f_i π_i`` uses its own assignments and its
    own tokens' probabilities. With one sequence it is :func:`balance_loss` of the batch.
    """
    probs = torch.as_tensor(probs)
    expert_index = torch.as_tensor(expert_index)
    if probs.dim() != 2 or not probs.is_floating_point():
        raise ValueError(f"sequence_balance_loss: probs must be a floating-point (tokens, experts) matrix, got "
                         f"shape {tuple(probs.shape)} and dtype {probs.dtype}")
    T, E = probs.shape
    _whole(seq_len, "seq_len (tokens per sequence)")
    if expert_index.dim() != 2 or expert_index.shape[0] != T:
        raise ValueError(f"sequence_balance_loss: expert_index must be ({T}, k), got {tuple(expert_index.shape)}")
    if T % seq_len:
        raise ValueError(f"sequence_balance_loss: {T} tokens do not split into sequences of {seq_len}")
    n = T // seq_len
    k = expert_index.shape[1]
    onehot = F.one_hot(expert_index.reshape(n, seq_len * k), E).to(probs.dtype)   # (n, s·k, E)
    f = onehot.sum(1) / (seq_len * k)                                             # (n, E)
    pi = probs.reshape(n, seq_len, E).mean(1)                                     # (n, E)
    return (E * (f * pi).sum(-1)).mean()


# ---------------------------------------------------------------------------- grouped GEMM

#: how :func:`grouped_swiglu` multiplies: one product per expert, one padded batched
#: product, or torch's grouped matrix multiply.
EXPERT_IMPLS = ("loop", "padded", "grouped_mm")


def grouped_swiglu(x: torch.Tensor, sizes, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   impl: str = "padded", pad_to: int | None = None) -> torch.Tensor:
    """E SwiGLU experts, ``w2_e (silu(w1_e x) ⊙ w3_e x)``, on tokens already grouped by expert.

    ``x`` is (A, h): the first ``sizes[0]`` rows are expert 0's, the next ``sizes[1]`` expert
    1's, … (:meth:`Route.assignments` gives this order); ``w1`` and ``w3`` are (E, f, h), ``w2``
    (E, h, f). Returns the (A, h) outputs, row for row. ``impl`` says how:

    - ``"loop"``: one product per expert and matrix, 3E calls — the naive form, Megatron-Core's
      ``SequentialMLP``;
    - ``"padded"``: each expert's rows copied into an (E, n_max, h) buffer, n_max = ``pad_to``
      (by default the largest of ``sizes``), zero rows below; three ``torch.bmm`` calls for all
      experts. Padding to the capacity C is the static-shape layout of GShard and Switch;
      the padding rows are computed and thrown away (:func:`padded_rows` counts them);
    - ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` with the per-expert row offsets,
      three calls, no padding rows here — the grouped GEMM of dropless MoE (Megatron-Core's
      ``moe_grouped_gemm``, MegaBlocks' ``mlp_impl="grouped"``, torchtitan's
      ``GroupedExperts``). GPU kernels may still round each expert's rows up to a tile: DeepGEMM
      aligns every expert's segment to its block of rows, and Megatron-Core pads each to 16 rows
      for FP8 (32 for MXFP8, 256 on Transformer Engine's grouped-tensor path) — a few rows per
      expert, not a capacity. It takes float32, bfloat16 or float16 (not float64), with rows of
      16-byte multiples (``h`` and ``f`` times the element size); on CPU, torch 2.13 runs it as
      a loop of ``mm`` over the groups (ATen's ``_grouped_mm_fallback``).

    All three are differentiable in ``x`` and the weights, and equal up to rounding.
    """
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"grouped_swiglu: impl must be one of {EXPERT_IMPLS}, got {impl!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"grouped_swiglu: x must be a floating-point (rows, h) tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    E, f, h = w1.shape
    if tuple(w3.shape) != (E, f, h) or tuple(w2.shape) != (E, h, f) or x.shape[1] != h:
        raise ValueError(f"grouped_swiglu: w1, w3 must be (E, f, h), w2 (E, h, f) and x (rows, h); got "
                         f"{tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)} and {tuple(x.shape)}")
    sizes = [int(_whole(n, "an expert's row count", minimum=0)) for n in sizes]
    if len(sizes) != E or sum(sizes) != x.shape[0]:
        raise ValueError(f"grouped_swiglu: sizes must give {E} row counts adding up to the {x.shape[0]} rows "
                         f"of x, got {len(sizes)} adding up to {sum(sizes)}")
    if impl == "loop":
        # unbind, not w1[e]: each w1[e]'s backward would write a zero-filled (E, f, h) gradient
        parts = [(F.silu(rows @ a.T) * (rows @ b.T)) @ c.T
                 for rows, a, b, c in zip(x.split(sizes), w1.unbind(), w3.unbind(), w2.unbind())]
        return torch.cat(parts) if parts else x.new_zeros(0, h)
    if impl == "padded":
        n_max = max(sizes, default=0) if pad_to is None else _whole(pad_to, "pad_to (rows per expert)", minimum=0)
        if n_max < max(sizes, default=0):
            raise ValueError(f"grouped_swiglu: pad_to={n_max} is fewer rows than the busiest expert's {max(sizes)}")
        counts = torch.tensor(sizes, device=x.device)
        expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts)        # (A,)
        start = torch.cumsum(counts, 0) - counts
        row = torch.arange(x.shape[0], device=x.device) - start[expert]                   # place within its expert
        buf = x.new_zeros(E, n_max, h).index_put((expert, row), x)                         # (E, n_max, h)
        hidden = F.silu(torch.bmm(buf, w1.transpose(1, 2))) * torch.bmm(buf, w3.transpose(1, 2))
        return torch.bmm(hidden, w2.transpose(1, 2))[expert, row]                        # (A, h)
    # grouped_mm
    if pad_to is not None:
        raise ValueError("grouped_swiglu: pad_to is for impl='padded'; grouped_mm needs no padding")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"grouped_swiglu: torch's grouped_mm takes float32, bfloat16 or float16, not {x.dtype}")
    if (h * x.element_size()) % 16 or (f * x.element_size()) % 16:
        raise ValueError(f"grouped_swiglu: torch's grouped_mm needs rows of a multiple of 16 bytes; h={h} and "
                         f"f={f} in {x.dtype} give {h * x.element_size()} and {f * x.element_size()}")
    offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)                 # each group's end row
    hidden = F.silu(F.grouped_mm(x, w1.transpose(1, 2), offs=offs)) * F.grouped_mm(x, w3.transpose(1, 2), offs=offs)
    return _ContiguousGrad.apply(F.grouped_mm(hidden, w2.transpose(1, 2), offs=offs))


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: grouped_mm's backward refuses
    a broadcast one (``y.sum().backward()`` sends an expanded tensor of stride 0: "Invalid
    strides/sizes" in torch 2.13)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def padded_rows(sizes, pad_to: int | None = None) -> int:
    """Rows the ``"padded"`` layout multiplies: E · n_max, n_max = ``pad_to`` or the largest of
    ``sizes`` (against ``sum(sizes)`` rows of real work)."""
    sizes = [int(n) for n in sizes]
    return len(sizes) * (max(sizes, default=0) if pad_to is None else int(pad_to))


# ---------------------------------------------------------------------------- the layer

class SharedExpert(nn.ModuleDict):
    """A SwiGLU MLP every token passes through, beside the routed experts (DeepSeek-V3's shared
    expert): ``w2(silu(w1 x) ⊙ w3 x)``, its three bias-free linear layers indexed by name."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__(dict(w1=nn.Linear(hidden, ffn, bias=False), w3=nn.Linear(hidden, ffn, bias=False),
                              w2=nn.Linear(ffn, hidden, bias=False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self["w2"](F.silu(self["w1"](x)) * self["w3"](x))


class MoELayer(nn.Module):
    """Router, ``experts`` SwiGLU experts and an optional shared expert; tokens ``(T, h)``.

    ``forward`` sorts the kept assignments by expert and runs each expert once on its
    contiguous batch of tokens; ``forward_naive`` routes on its own, one token at a time,
    and loops over tokens and their k experts. Both return ``(output, route)``; dropped
    assignments contribute nothing (the token keeps only what the residual connection
    around the layer carries).
    """

    def __init__(self, hidden: int, ffn: int, experts: int, k: int, capacity_factor: float = 1.25,
                 shared: bool = False, groups: int = 1, top_groups: int | None = None):
        super().__init__()
        _whole(hidden, "hidden size")
        _whole(ffn, "expert width")
        _whole(experts, "number of experts")
        if not 1 <= _whole(k, "k") <= experts:
            raise ValueError(f"k={k} must lie between 1 and the {experts} experts")
        capacity(1, 1, 1, capacity_factor)                # the factor must be > 0
        self.hidden, self.ffn, self.k, self.capacity_factor = hidden, ffn, k, capacity_factor
        self.groups, self.top_groups = groups, top_groups
        self.router = nn.Linear(hidden, experts, bias=False)
        scale = 1 / math.sqrt(hidden)
        self.w1 = nn.Parameter(torch.randn(experts, ffn, hidden) * scale)       # gate projection
        self.w3 = nn.Parameter(torch.randn(experts, ffn, hidden) * scale)       # up projection
        self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn) / math.sqrt(ffn))   # down projection
        self.shared = SharedExpert(hidden, ffn) if shared else None

    @property
    def experts(self) -> int:
        return self.w1.shape[0]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens x (n, h): w2 · (silu(w1 x) ⊙ w3 x)."""
        return (F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)) @ self.w2[e].T   # (n, h)

    def _check(self, x):
        check_tokens(x, self.hidden, self.router.weight, "MoELayer")

    def route(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> Route:
        return topk_route(self.router(x), self.k, self.capacity_factor, bias, self.groups, self.top_groups)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None):
        self._check(x)
        r = self.route(x, bias)
        token, expert, weight = r.assignments()                                            # (A,), by expert
        sizes = torch.bincount(expert, minlength=self.experts).tolist()
        out = torch.zeros_like(x)
        for e, (tok, w) in enumerate(zip(token.split(sizes), weight.split(sizes))):
            # every expert runs, even on no tokens, so the output always depends on the
            # weights (an empty batch of tokens still has a gradient: zero)
            out = out.index_add(0, tok, self.expert(e, x[tok]) * w.unsqueeze(1))
        if self.shared is not None:
            out = out + self.shared(x)
        return out, r

    def forward_grouped(self, x: torch.Tensor, bias: torch.Tensor | None = None, impl: str = "padded",
                        pad_to: int | None = None):
        """:meth:`forward` with the experts as a grouped GEMM: the same routing and combine, the
        kept assignments' tokens multiplied by :func:`grouped_swiglu` (``impl`` "padded",
        "grouped_mm" or "loop"; ``pad_to``, e.g. ``route.capacity``, for "padded") — three calls
        for all experts instead of three per expert. Returns ``(output, route)``."""
        self._check(x)
        r = self.route(x, bias)
        token, expert, weight = r.assignments()                                            # (A,), by expert
        sizes = torch.bincount(expert, minlength=self.experts).tolist()
        y = grouped_swiglu(x[token], sizes, self.w1, self.w3, self.w2, impl, pad_to)      # (A, h)
        out = torch.zeros_like(x).index_add(0, token, y * weight.unsqueeze(1))
        if self.shared is not None:
            out = out + self.shared(x)
        return out, r

    def forward_naive(self, x: torch.Tensor, bias: torch.Tensor | None = None):
        """The reference. It shares no routing code with :meth:`forward`: each token's k
        experts come from sorting its own scores (within its best groups when ``groups`` >
        1); one queue per expert is then filled in the order :func:`topk_route` promises —
        every token's first choice in token order, then every second choice, … — an
        assignment kept while its expert has room. Then each token, each kept expert, one
        at a time.
        """
        self._check(x)
        logits = self.router(x)                                                   # (T, E)
        _check_bias(bias, logits, "MoELayer")
        T, E, k = x.shape[0], self.experts, self.k
        top_groups = self.groups if self.top_groups is None else self.top_groups
        _check_groups(E, k, self.groups, top_groups)
        scores = (logits if bias is None else logits + bias).tolist()             # bias: for the choice only
        chosen = [self._choose(row, top_groups) for row in scores]                # T lists of k experts, best first
        cap = capacity(T, E, k, self.capacity_factor)
        room = [cap] * E
        kept = [[False] * k for _ in range(T)]
        for j in range(k):                                                        # choice rank first …
            for t in range(T):                                                    # … then token order
                e = chosen[t][j]
                if room[e] > 0:
                    room[e] -= 1
                    kept[t][j] = True
        rows, weights = [], []
        for t in range(T):
            w = torch.softmax(logits[t, chosen[t]], dim=0)                        # (k,): unbiased, chosen only
            y = torch.zeros_like(x[t])                                            # (h,)
            for j in range(k):
                if kept[t][j]:
                    y = y + w[j] * self.expert(chosen[t][j], x[t:t + 1])[0]
            rows.append(y)
            weights.append(w)
        out = torch.stack(rows) if rows else torch.zeros_like(x)                  # (T, h)
        if self.shared is not None:
            out = out + self.shared(x)
        index = torch.tensor(chosen, dtype=torch.long, device=x.device).reshape(T, k)
        route = Route(index, torch.stack(weights) if weights else logits.new_zeros(0, k),
                      torch.tensor(kept, dtype=torch.bool, device=x.device).reshape(T, k),
                      torch.bincount(index.flatten(), minlength=E), cap, torch.softmax(logits, dim=-1))
        return out, route

    def _choose(self, row: list[float], top_groups: int) -> list[int]:
        """One token's k experts, best first, by sorting its scores (ties: the lower index)."""
        allowed = list(range(len(row)))
        if self.groups > 1:
            n = len(row) // self.groups
            group_score = [sum(sorted(row[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(self.groups)]
            best = sorted(range(self.groups), key=lambda g: -group_score[g])[:top_groups]
            allowed = sorted(e for g in best for e in range(g * n, (g + 1) * n))
        return sorted(allowed, key=lambda e: -row[e])[:self.k]
