"""A planner: memory, communication and time per GPU for a model, a cluster and a layout (chapter 08).

Every formula is one the earlier chapters built or measured, extended where a real model
needs it:

- parameters: dense layers counted tensor by tensor (chapter 01–02), MoE models through
  :func:`intralayer.moe.count_params` (chapter 05);
- weights, gradients and optimizer state in mixed precision: 2 + 2 + 12 bytes per
  parameter (bf16 weights and gradients; fp32 master weights, Adam's two moments), with
  ZeRO stages 1–3 sharding the optimizer state, then the gradients, then the weights over
  the data-parallel group (Rajbhandari et al. 2020). Megatron-LM's estimate
  (``theoretical_memory_usage.py``) counts 18 bytes, with fp32 gradients; so did Llama 3 and
  DeepSeek-V3: the 2-byte gradients here are half of theirs;
- pipeline stages hold ``ceil(L/pp)`` layers at most (the planner sizes the fullest);
- activations: Korthikanti et al.'s per-layer terms (:mod:`intralayer.memory`, chapter 03)
  on the sequence each GPU holds (``s/cp``) with a fused attention kernel, adjusted for
  grouped-query attention (K and V are ``kv_heads/heads`` of Q) and for the MLP width
  (SwiGLU keeps three ``ffn``-wide tensors where GeLU keeps two ``4h``-wide ones; an MoE
  layer keeps them for ``k`` experts per token, plus the shared ones). Under pipeline
  parallelism with 1F1B the first stage holds ``L`` layers' worth (Korthikanti et al.);
- expert parallelism is carved out of data × context parallelism (``ep`` divides ``dp·cp``),
  with each expert whole on its GPU: the classic layout. Megatron-Core's MoE parallel
  folding, where the MoE layers get a grid of their own (expert tensor × expert × expert
  data parallelism) and expert parallelism can span the tensor-parallel ranks too, is
  not modelled;
- communication per GPU and step: tensor parallelism 4 all-reduces of ``s·b·h`` per layer
  and micro-batch (chapter 02), context parallelism the ring's k/v blocks (chapter 04),
  expert parallelism two all-to-alls each way per MoE layer (chapter 06), pipeline
  parallelism one activation each way per micro-batch and stage boundary, data
  parallelism one all-reduce of the gradients per step (ring: 2(n−1)/n of them);
- time: 6 FLOPs per active parameter and token plus attention's ``12·L·h·s`` per token
  (Narayanan et al. 2021, without recomputation), at an assumed sustained fraction of peak;
  TP, CP and EP traffic exposed, data-parallel traffic hidden behind the backward pass where
  it fits, and the plain 1F1B pipeline bubble, ``(pp−1)/m`` of the compute for ``m``
  micro-batches (``(pp−1)/(m+pp−1)`` of the pipeline's time; no interleaved schedule);
- MFU: ``6·N_active`` FLOPs per token over the step time and the peak, without attention's
  ``12·L·h·s`` (which PaLM's definition, used by Llama 3, counts).

What it leaves out is listed in chapter 08: kernel efficiencies, overlap of TP/EP
traffic, interleaved and other pipeline schedules, the forward all-reduces that full
recomputation repeats, memory fragmentation and framework buffers, the embedding's extra
activations, MLA's exact activation shapes, and load imbalance between experts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import moe
from .rules import whole as _whole
from .comm import bus_factor
from .memory import RECOMPUTE, activation_terms


# ---------------------------------------------------------------------------- presets

@dataclass(frozen=True)
class Model:
    """A decoder-only transformer as the planner needs it."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int                      # dense MLP width
    vocab: int
    mlp_matrices: int = 2         # 2: GeLU (h→ffn→h); 3: SwiGLU
    experts: int = 0              # 0: dense
    top_k: int = 0
    moe_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    moe_config: moe.MoEConfig | None = None
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class Cluster:
    """GPUs, how they are wired, and what each can do."""

    name: str
    gpus: int
    gpus_per_node: int            # the fast (NVLink) domain
    memory: float                 # bytes per GPU
    intra: float                  # bytes/s per GPU, one way, inside the domain
    inter: float                  # bytes/s per GPU, one way, between domains
    peak: float                   # dense bf16 FLOP/s per GPU
    source: str = ""


MODELS = {
    "GPT-3 175B": Model("GPT-3 175B", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=4 * 12288, vocab=51200,
                        source="Brown et al. 2020; Korthikanti et al. 2022, Table 3"),
    "Llama 3 70B": Model("Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                         mlp_matrices=3, source="Llama Team 2024, Table 3"),
    "Llama 3 405B": Model("Llama 3 405B", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
                          mlp_matrices=3, source="Llama Team 2024, Table 3"),
    "Mixtral 8x7B": Model("Mixtral 8x7B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                          mlp_matrices=3, experts=8, top_k=2, moe_ffn=14336, moe_config=moe.MIXTRAL_8X7B,
                          source=moe.MIXTRAL_8X7B.source),
    "DeepSeek-V3": Model("DeepSeek-V3", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432, vocab=129280,
                         mlp_matrices=3, experts=256, top_k=8, moe_ffn=2048, shared_experts=1, dense_layers=3,
                         moe_config=moe.DEEPSEEK_V3, source=moe.DEEPSEEK_V3.source),
}

CLUSTERS = {
    "1024× H100 (128 nodes of 8, InfiniBand)": Cluster(
        "1024× H100 (128 nodes of 8, InfiniBand)", gpus=1024, gpus_per_node=8, memory=80e9, intra=450e9,
        inter=50e9, peak=989e12, source="NVIDIA H100 datasheet; ConnectX-7 NDR 400 Gb/s, one NIC per GPU"),
    "A100 cluster (nodes of 8, InfiniBand HDR)": Cluster(
        "A100 cluster (nodes of 8, InfiniBand HDR)", gpus=4096, gpus_per_node=8, memory=80e9, intra=300e9,
        inter=25e9, peak=312e12, source="NVIDIA A100 datasheet: 80 GB, 312 TFLOP/s dense bf16, 600 GB/s NVLink "
                                        "both ways; HDR InfiniBand 200 Gb/s, one NIC per GPU"),
    "GB200 NVL72 (one rack)": Cluster(
        "GB200 NVL72 (one rack)", gpus=72, gpus_per_node=72, memory=186e9, intra=900e9, inter=50e9,
        peak=2.5e15, source="NVIDIA GB200 NVL72 (vendor figures): about 13.4 TB of HBM3e over 72 GPUs, "
                            "1.8 TB/s NVLink per GPU, 2.5 PFLOP/s dense bf16 per GPU"),
}


# ---------------------------------------------------------------------------- parameters

def _attention_params(m: Model) -> int:
    d = m.hidden // m.heads
    return m.hidden * m.heads * d * 2 + 2 * m.hidden * m.kv_heads * d            # q, o; k, v


def params(m: Model) -> dict:
    """Total and active parameters, and what one layer's dense part and experts hold."""
    if m.moe_config is not None:
        total, active = moe.count_params(m.moe_config)
        parts = moe.param_breakdown(m.moe_config)
        experts = parts["routed experts"][0]
        embedding = parts["embedding"][0] + parts["output head"][0]
    else:
        per_layer = _attention_params(m) + m.mlp_matrices * m.hidden * m.ffn + 2 * m.hidden
        embedding = 2 * m.vocab * m.hidden
        total = active = m.layers * per_layer + embedding + m.hidden
        experts = 0
    return dict(total=total, active=active, experts=experts, dense=total - experts - embedding,
                embedding=embedding)


# ---------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    """Per GPU: memory by component, bytes sent per step by strategy, and the time estimate."""

    memory_bytes: dict
    comm_bytes: dict
    crosses_nodes: dict
    time: dict
    mfu: float
    gpus: int

    @property
    def fits(self) -> bool:
        return self.memory_bytes["total"] <= self.memory_bytes["capacity"]


def check_layout(m: Model, c: Cluster, tp=1, sp=False, cp=1, ep=1, pp=1, dp=1, micro_batch=1, seq_len=2048,
                 recompute="none", zero=0) -> None:
    """Every rule a layout must follow, each a ``ValueError`` naming the numbers."""
    for value, what in ((tp, "tp"), (cp, "cp"), (ep, "ep"), (pp, "pp"), (dp, "dp"), (micro_batch, "micro_batch"),
                        (seq_len, "seq_len")):
        _whole(value, what)
    gpus = tp * cp * pp * dp
    if c.gpus % gpus:
        raise ValueError(f"tp·cp·pp·dp = {tp}·{cp}·{pp}·{dp} = {gpus} GPUs does not divide the cluster's {c.gpus}")
    if m.heads % tp:
        raise ValueError(f"{m.heads} attention heads are not divisible by tp={tp}")
    if m.kv_heads % tp and tp % m.kv_heads:
        raise ValueError(f"{m.kv_heads} key/value heads and tp={tp}: one must divide the other")
    if m.hidden % tp or (m.ffn % tp) or (m.is_moe and m.moe_ffn % tp):
        raise ValueError(f"the hidden size {m.hidden} and MLP widths must be divisible by tp={tp}")
    if pp > m.layers:
        raise ValueError(f"pp={pp} pipeline stages is more than the model's {m.layers} layers")
    if seq_len % (2 * cp if cp > 1 else 1):
        raise ValueError(f"seq_len {seq_len} is not divisible by 2·cp = {2 * cp} (zigzag context parallelism)")
    if sp and (seq_len // cp) % tp:
        raise ValueError(f"sequence parallelism needs tp={tp} to divide the {seq_len // cp} tokens per cp rank")
    if sp and tp == 1:
        raise ValueError("sequence parallelism needs tp > 1")
    if ep > 1 and not m.is_moe:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model; {m.name} is dense")
    if m.is_moe and m.experts % ep:
        raise ValueError(f"{m.experts} experts do not split evenly over ep={ep}")
    if (dp * cp) % ep:
        raise ValueError(f"expert parallelism is carved out of data × context parallelism: ep={ep} must divide "
                         f"dp·cp = {dp * cp}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")


def layer_activation_bytes(m: Model, s: int, b: int, tp: int, sp: bool, recompute: str, moe_layer: bool,
                           fused: bool = True) -> float:
    """One layer's activations on one GPU (bf16, fused attention), Korthikanti's terms adjusted.

    Grouped-query attention keeps K and V at ``kv_heads/heads`` of Q's size; the MLP keeps
    its two wide tensors (GeLU input and fc2 input, ``4h`` each in the paper) at the real
    width: ``ffn`` per matrix of the up-projection (SwiGLU has two) and the down-projection's
    input, times ``k`` experts per token (+ shared) in an MoE layer.
    """
    terms = activation_terms(s, b, m.hidden, m.heads, t=tp, sp=sp, recompute=recompute, fused=fused)
    if recompute == "full":
        return float(sum(terms.values()))
    sbh = s * b * m.hidden * 2 / tp                                                   # one (s, b, h/t) bf16 tensor
    kv = m.kv_heads / m.heads
    terms["Q and K"] = sbh * (1 + kv)
    terms["V"] = sbh * kv
    width = (m.top_k + m.shared_experts) * m.moe_ffn if moe_layer else m.ffn
    per_wide = s * b * width * 2 / tp                                                 # one (s, b, width/t) tensor
    terms["GeLU input"] = per_wide * (m.mlp_matrices - 1)                             # GeLU: 1; SwiGLU: gate and up
    terms["fc2 input"] = per_wide
    return float(sum(terms.values()))


def plan(model: Model, cluster: Cluster, tp: int = 1, sp: bool = False, cp: int = 1, ep: int = 1, pp: int = 1,
         dp: int = 1, micro_batch: int = 1, seq_len: int = 2048, recompute: str = "none", zero: int = 0,
         global_batch: int | None = None, efficiency: float = 0.5, fused: bool = True) -> Plan:
    """Memory, traffic and time per GPU for ``model`` on ``cluster`` with this layout.

    A step processes ``global_batch`` sequences of ``seq_len`` tokens (default: 8
    micro-batches per pipeline, at least ``pp``), so layouts of the same cluster can be
    compared on the same work. ``efficiency`` is the assumed sustained fraction of peak;
    ``fused=False`` counts attention's s×s tensors as Korthikanti et al. did (no
    FlashAttention-style kernel).
    """
    m, c = model, cluster
    check_layout(m, c, tp, sp, cp, ep, pp, dp, micro_batch, seq_len, recompute, zero)
    if global_batch is None:
        global_batch = dp * micro_batch * max(pp, 8)
    _whole(global_batch, "global_batch")
    if global_batch % (dp * micro_batch):
        raise ValueError(f"global batch {global_batch} is not a whole number of micro-batches of {micro_batch} "
                         f"on each of dp={dp} replicas")
    mb = global_batch // (dp * micro_batch)                                              # micro-batches per replica
    if pp > 1 and mb < pp:
        raise ValueError(f"{mb} micro-batches per replica cannot fill pp={pp} pipeline stages")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must lie in (0, 1], got {efficiency}")
    gpus = tp * cp * pp * dp
    p = params(m)
    # --- weights, gradients, optimizer state (bytes per GPU); experts are not split by tp here
    stage_share = math.ceil(model.layers / pp) / model.layers                           # the fullest stage
    dense_local = p["dense"] * stage_share / tp + p["embedding"] / (2 * tp)             # + the first/last stage's table
    expert_local = p["experts"] * stage_share / ep
    local = dense_local + expert_local
    shard_dense, shard_experts = dp * cp, (dp * cp) // ep                                # replicas to shard over
    sharded = dense_local / shard_dense + expert_local / shard_experts                  # one ZeRO shard's parameters
    weights = 2 * (local if zero < 3 else sharded)
    grads = 2 * (local if zero < 2 else sharded)
    optim = 12 * (local if zero < 1 else sharded)
    # --- activations: L layers' worth on the first stage (1F1B), sequence s/cp
    s_local = seq_len // cp
    moe_layers = m.layers - m.dense_layers if m.is_moe else 0
    per_dense = layer_activation_bytes(m, s_local, micro_batch, tp, sp, recompute, False, fused)
    per_moe = layer_activation_bytes(m, s_local, micro_batch, tp, sp, recompute, True, fused) if m.is_moe else 0.0
    stage = math.ceil(m.layers / pp)                                                    # the fullest stage's layers
    share = stage / m.layers
    activations = ((m.layers - moe_layers) * per_dense + moe_layers * per_moe) * share * min(pp, mb)
    memory = dict(weights=weights, gradients=grads, optimizer=optim, activations=activations)
    memory["total"] = sum(memory.values())
    memory["capacity"] = c.memory
    # --- communication per GPU per step (bytes sent)
    layers_here = math.ceil(m.layers / pp)
    sbh = s_local * micro_batch * m.hidden * 2                                           # one bf16 activation
    comm = {"tp": 4 * bus_factor("all_reduce", tp) * sbh * layers_here * mb}
    kv_block = micro_batch * s_local * (m.hidden // tp) * 2 * m.kv_heads / m.heads      # this rank's k (or v)
    comm["cp"] = (2 * (cp - 1) * kv_block * 2 + 2 * cp * kv_block * 2) * layers_here * mb if cp > 1 else 0.0
    tokens_local = s_local * micro_batch / (tp if sp else 1)
    moe_here = math.ceil(moe_layers / pp)
    comm["ep"] = 4 * tokens_local * m.top_k * m.hidden * 2 * (ep - 1) / ep * moe_here * mb if ep > 1 else 0.0
    comm["pp"] = 2 * sbh / (tp if sp else 1) * mb if pp > 1 else 0.0
    comm["dp"] = bus_factor("all_reduce", dp * cp) * 2 * local if dp * cp > 1 else 0.0   # bf16 gradients
    # --- which groups leave the fast domain (Megatron's rank order: tp, cp, dp, pp)
    g = c.gpus_per_node
    crosses = dict(tp=tp > g, cp=cp > 1 and tp * cp > g, ep=ep > 1 and tp * cp * ep > g,
                   dp=dp * cp > 1 and tp * cp * dp > g, pp=pp > 1 and tp * cp * dp * pp > g)
    bw = {k: (c.inter if v else c.intra) for k, v in crosses.items()}
    # --- time per step: the step's work spread over all GPUs
    tokens_step = global_batch * seq_len
    flops_token = 6 * p["active"] + 12 * m.layers * m.hidden * seq_len
    if recompute == "full":
        flops_token *= 8 / 6                                                             # the forward runs twice
    compute = flops_token * tokens_step / gpus / (c.peak * efficiency)
    exposed = {k: comm[k] / bw[k] for k in ("tp", "cp", "ep", "pp")}
    exposed["dp"] = max(0.0, comm["dp"] / bw["dp"] - compute * 2 / 3)                   # hidden behind backward
    bubble = compute * (pp - 1) / mb
    total = compute + sum(exposed.values()) + bubble
    mfu = 6 * p["active"] * tokens_step / (total * gpus * c.peak)
    time = dict(compute=compute, bubble=bubble, **{f"{k} comm": v for k, v in exposed.items()}, total=total)
    return Plan(memory, comm, crosses, time, mfu, gpus)


def search(model: Model, cluster: Cluster, seq_len: int = 4096, global_batch: int = 1024, micro_batch: int = 1,
           gpus: int | None = None) -> list[tuple[dict, Plan]]:
    """Every valid layout on ``gpus`` GPUs (the whole cluster by default) that fits memory,
    fastest first, all doing the same work per step (``global_batch`` sequences). Degrees
    run over divisors, tp within a node; sequence parallelism is on whenever tp > 1 and
    ZeRO-1 always; recomputation none or full (with the fused attention the planner
    assumes, selective recomputation keeps exactly what no recomputation keeps)."""
    n = cluster.gpus if gpus is None else gpus
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    found = []
    for tp in [d for d in divisors if d <= cluster.gpus_per_node]:
        for cp in divisors:
            for pp in divisors:
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                for ep in ([e for e in divisors if (dp * cp) % e == 0] if model.is_moe else [1]):
                    for recompute in ("none", "full"):       # fused attention: "selective" saves nothing more
                        kw = dict(tp=tp, sp=tp > 1, cp=cp, ep=ep, pp=pp, dp=dp, micro_batch=micro_batch,
                                  seq_len=seq_len, recompute=recompute, zero=1, global_batch=global_batch)
                        try:
                            pl = plan(model, cluster, **kw)
                        except ValueError:
                            continue
                        if pl.fits:
                            found.append((kw, pl))
    found.sort(key=lambda item: item[1].time["total"])
    return found
