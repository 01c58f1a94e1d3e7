"""A planner: memory, communication and time per GPU for a model, a cluster and a layout (chapter 08).

Every formula is one the earlier chapters built or measured, extended where a real
training system needs it, and held against published training runs (:data:`RECORD`).
It is built from pieces, each a function of one checked :class:`Layout`: :func:`stage_memory`,
:func:`layer_time`, :func:`tp_cost`, :func:`cp_cost`, :func:`ep_cost`, :func:`pipeline_cost` and
:func:`dp_cost` (with :func:`tp_products`, :func:`layer_costs` and :func:`stage_time` between them);
:func:`plan` makes the Layout and :func:`plan_of` adds the pieces up into a :class:`Plan` of typed,
frozen results: :class:`Memory`, :class:`CommBytes`, :class:`CrossesNodes`, :class:`StepTime`,
:class:`StepFlops` and :class:`Efficiency`.

- **FLOPs** as Narayanan et al. 2021 count them (eq. 3 and its appendix): per token, 6 per
  multiply-add parameter of the layers' and the output head's matrix products, plus
  attention's scores and weighted sum, ``6·s·a·(d_qk + d_v)`` per layer (``12·s·h`` for
  multi-head attention), all keys counted (no causal saving): model FLOPs. Grouped-query
  attention, SwiGLU, MLA and MoE enter through the parameters a token multiplies (an MoE
  layer: its ``k`` routed experts, shared experts and router). Hardware FLOPs add what
  recomputation repeats: the layers' forward pass (full, Narayanan et al.'s 96·…), or
  attention's two products forward, ``4·s·h`` per token and layer (selective, as Korthikanti
  et al. 2022 describe it; their eq. 8 counts more), or MLA's up-projections.
  :attr:`Plan.mfu` and :attr:`Plan.hfu` divide the two by the step time and the GPUs'
  dense bf16 peak.
- **Kernel efficiency** (:class:`KernelCurve`): the fraction of peak a layer's kernels
  reach, ``η(n) = η_max · n / (n + n_half)``, rising with the size of the per-GPU matrix
  products, ``n = sqrt(h · w/t)`` for an MLP of width ``w`` split ``t`` ways (chapter 02
  measured the same rise on a CPU); one curve per GPU generation, fitted on published runs
  (:func:`calibrate`), tested on others. Read as time: the products at ``η_max`` plus
  ``n_half/n`` of that for the layer's other kernels, which FP8 does not speed up. A curve
  belongs to the software stacks of its fit runs too (:attr:`KernelCurve.stacks`); a run on
  another stack is predicted as a range, :data:`STACK_BAND` either side (:func:`stack_band`,
  :attr:`Plan.mfu_range`, :attr:`Plan.time_range`), the gap MegaScale published between two
  stacks on the same model and GPUs.
- **Memory** as Megatron-LM's ``theoretical_memory_usage.py`` counts model states: 18 bytes
  per parameter (bf16 weights, fp32 gradients, fp32 master weights and two Adam moments),
  ``6 + 12/d`` with the distributed optimizer (ZeRO-1) over ``d`` replicas; bf16 gradients
  and ZeRO-2/3 as options; the most loaded pipeline stage holds its layers and one
  embedding table (both at ``pp = 1``). Activations: Korthikanti et al.'s per-layer terms
  (:mod:`intralayer.memory`, chapter 03) on the ``s/cp`` tokens a GPU holds, adjusted for
  grouped-query attention, the MLP's real width, models without dropout, and MoE layers (the
  ``k`` routed copies of each token, their expert activations and outputs); the first stage
  holds ``L`` layers' worth under 1F1B, and interleaved the chunks of Megatron-LM's warm-up,
  ``2(pp−1) + (vpp−1)·G + 1`` for ``G`` micro-batches per virtual stage (``1 + (pp−1)/(pp·vpp)``
  times ``L`` layers' worth at the default ``G = pp``); at ``pp = 1`` the output head's
  logits too.
- **Time** per step: ``m`` micro-batches through the slowest pipeline stage (its layers, the
  output head on the last stage), each at ``η`` of peak (FP8 matrix products at the FP8 peak
  when ``fp8``), plus the communication that is not hidden:

  * tensor parallelism: 4 collectives of ``s·b·h`` per layer and micro-batch (6 with full
    recomputation; with sequence parallelism each a reduce-scatter and an all-gather, and 2 more
    all-gathers backward, chapter 03), ring bytes ``2(t−1)/t`` (chapter 02); exposed, or the backward ones
    hidden behind the weight-gradient products (``tp_overlap="backward"``, as Korthikanti
    et al. describe Megatron-LM), or each reduce-scatter and all-gather behind the one product beside it
    (``"all"``, Transformer Engine's overlap, chapter 07);
  * context parallelism: the ring's ``K``, ``V`` blocks (:func:`context_parallel.cp_costs`),
    hidden where a step's attention covers its transfer (chapter 04), or an exposed
    all-gather of ``K`` and ``V`` (``cp_method="allgather"``, Llama 3);
  * expert parallelism: dispatch and combine, forward and backward, per MoE layer; one copy
    per assignment, or one per destination node (``dedup``, chapter 06, with
    :func:`expected_nodes`), optionally overlapped with another micro-batch's compute while
    ``comm_sms`` of the GPU's SMs serve the communication (chapter 07);
  * pipeline: one activation each way per micro-batch and stage boundary (``vpp`` times as
    many interleaved), and the bubble, ``(pp−1)/vpp`` micro-batches' time (interleaved
    1F1B, Narayanan et al. 2021) or DualPipe's ``(pp/2−1)(F&B + B − 3W)`` (DeepSeek-V3);
  * data parallelism: gradient reduce-scatter and parameter all-gather (ZeRO ≥ 1) or an
    all-reduce, overlapped only with the last micro-batch's backward and the first one's
    forward (``dp_overlap``, Megatron's bucketed overlap) or exposed; ZeRO-2 and ZeRO-3 keep
    only a shard of the gradients, so every micro-batch reduce-scatters its own (overlapped
    with the next micro-batch's compute), and ZeRO-3 gathers the weights for every
    micro-batch's forward and backward pass.

What it leaves out is listed in chapter 08 beside the published runs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from . import moe
from .collectives import nccl_time
from .comm import bus_factor
from .context_parallel import cp_costs, n_chunks
from .memory import RECOMPUTE, activation_terms
from .rules import check_mesh, whole as _whole
from .hardware import A100_BF16_PEAK, GB200_BF16_PEAK, H100_BF16_PEAK, LINKS


# ---------------------------------------------------------------------------- models

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
    dropout: bool = True          # GPT-style dropout (masks kept for backward); Llama, Mixtral, DeepSeek: none
    source: str = ""

    @classmethod
    def from_moe(cls, c: moe.MoEConfig) -> "Model":
        """The planner's view of one of :mod:`intralayer.moe`'s presets: every number from ``c``."""
        return cls(c.name, layers=c.layers, hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads or c.heads,
                   ffn=c.ffn or c.moe_ffn, vocab=c.vocab, mlp_matrices=3, experts=c.experts, top_k=c.top_k,
                   moe_ffn=c.moe_ffn, shared_experts=c.shared_experts, dense_layers=c.dense_layers,
                   moe_config=c, dropout=False, source=c.source)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def head_dims(self) -> tuple[int, int]:
        """Per head: the width of a query·key product and of a value (MLA: 192 and 128)."""
        c = self.moe_config
        if c is not None and c.attention == "mla":
            return c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        d = (c.head_dim if c is not None and c.head_dim else self.hidden // self.heads)
        return d, d


def _attention_params(m: Model) -> int:
    """One layer's attention projections (q, k, v, o; MLA's low-rank ones from :mod:`moe`)."""
    if m.moe_config is not None:
        return moe.param_breakdown(m.moe_config)["attention"][0] // m.layers
    d = m.hidden // m.heads
    return m.hidden * m.heads * d * 2 + 2 * m.hidden * m.kv_heads * d            # q, o; k, v


def _up_projection_params(m: Model) -> int:
    """MLA's two up-projections (latent → per-head queries; latent → per-head keys and values)."""
    c = m.moe_config
    return c.q_lora_rank * c.heads * (c.qk_nope_head_dim + c.qk_rope_head_dim) + \
        c.kv_lora_rank * c.heads * (c.qk_nope_head_dim + c.v_head_dim)


def layer_params(m: Model) -> dict:
    """Parameters of one layer, by part: what a token multiplies in it, and what a GPU stores."""
    h = m.hidden
    out = dict(attention=_attention_params(m), mlp=m.mlp_matrices * h * m.ffn, norms=2 * h)
    if m.is_moe:
        expert = 3 * h * m.moe_ffn
        out.update(expert=expert, experts=m.experts * expert, shared=m.shared_experts * expert,
                   router=h * m.experts)
    return out


def params(m: Model) -> dict:
    """Total and active parameters, and the parts a layout splits differently."""
    if m.moe_config is not None:
        total, active = moe.count_params(m.moe_config)
        parts = moe.param_breakdown(m.moe_config)
        experts = parts["routed experts"][0]
        embedding = parts["embedding"][0] + parts["output head"][0]
    else:
        lp = layer_params(m)
        embedding = 2 * m.vocab * m.hidden
        total = active = m.layers * (lp["attention"] + lp["mlp"] + lp["norms"]) + embedding + m.hidden
        experts = 0
    return dict(total=total, active=active, experts=experts, dense=total - experts - embedding,
                embedding=embedding)


MODELS = {
    "GPT-3 175B": Model("GPT-3 175B", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=4 * 12288, vocab=51200,
                        source="Brown et al. 2020; Korthikanti et al. 2022, Table 3"),
    "Llama 3 70B": Model("Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                         mlp_matrices=3, dropout=False, source="Llama Team 2024, Table 3"),
    "Llama 3 405B": Model("Llama 3 405B", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
                          mlp_matrices=3, dropout=False, source="Llama Team 2024, Table 3"),
    "Mixtral 8x7B": Model.from_moe(moe.MIXTRAL_8X7B),
    "DeepSeek-V3": Model.from_moe(moe.DEEPSEEK_V3),
}


# ---------------------------------------------------------------------------- clusters

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
    generation: str = "Hopper"    # picks the calibrated kernel curve
    fp8_peak: float = 0.0         # dense FP8 FLOP/s per GPU (0: no FP8 tensor cores)
    sms: int = 132                # streaming multiprocessors per GPU
    net_overhead_us: float = 1.0  # NCCL's network overhead per step (getNetOverhead: 1 µs Intel x86, 2 AMD)


_NVLINK4, _NDR, _NVLINK5, _NVLINK3, _HDR = (
    LINKS[k].bandwidth for k in ("NVLink 4 (H100 SXM)", "InfiniBand NDR (1 NIC)", "NVLink 5 (GB200 NVL72)",
                                 "NVLink 3 (A100 SXM)", "InfiniBand HDR (1 NIC)"))
_H100 = "1024× H100 (128 nodes of 8, InfiniBand)"
_A100 = "A100 cluster (nodes of 8, InfiniBand HDR)"
_H800 = "2048× H800 (DeepSeek-V3's cluster)"
CLUSTERS = {
    _H100: Cluster(_H100, gpus=1024, gpus_per_node=8, memory=80e9, intra=_NVLINK4, inter=_NDR, peak=H100_BF16_PEAK,
                   source="NVIDIA H100 datasheet (80 GB, 989 TFLOP/s dense bf16, 1979 FP8, 900 GB/s NVLink both "
                          "ways); ConnectX-7 NDR 400 Gb/s, one NIC per GPU",
                   generation="Hopper", fp8_peak=2 * H100_BF16_PEAK, sms=132),
    _A100: Cluster(_A100, gpus=4096, gpus_per_node=8, memory=80e9, intra=_NVLINK3, inter=_HDR, peak=A100_BF16_PEAK,
                   source="NVIDIA A100 datasheet: 80 GB, 312 TFLOP/s dense bf16, 600 GB/s NVLink both ways; 108 "
                          "SMs (CUDA deviceQuery, A100-SXM4-80GB); HDR InfiniBand 200 Gb/s, one NIC per GPU (Selene: 8 per "
                          "node); DGX A100 nodes have two AMD EPYC 7742 CPUs (DGX A100 datasheet), for which NCCL "
                          "takes a 2 µs network overhead",
                   generation="Ampere", sms=108, net_overhead_us=2.0),
    _H800: Cluster(_H800, gpus=2048, gpus_per_node=8, memory=80e9, intra=160e9, inter=50e9, peak=H100_BF16_PEAK,
                   source="DeepSeek-V3 report §3.1–3.2: 2048 H800, 8 per node, NVLink 160 GB/s, InfiniBand 50 GB/s, "
                          "132 SMs; memory and peaks taken from the H100 datasheet (the report gives neither)",
                   generation="Hopper", fp8_peak=2 * H100_BF16_PEAK, sms=132),
    "GB200 NVL72 (one rack)": Cluster(
        "GB200 NVL72 (one rack)", gpus=72, gpus_per_node=72, memory=186e9, intra=_NVLINK5, inter=_NDR,
        peak=GB200_BF16_PEAK, source="NVIDIA GB200 NVL72 (vendor figures): about 13.4 TB of HBM3e over 72 GPUs, "
                            "1.8 TB/s NVLink per GPU, 2.5 PFLOP/s dense bf16 per GPU",
        generation="Blackwell"),
}


# ---------------------------------------------------------------------------- kernel efficiency

@dataclass(frozen=True)
class KernelCurve:
    """``η(n) = eta_max · n / (n + n_half)``: the fraction of peak a layer's kernels reach, fitted on the runs
    ``fitted_on``, made with the software ``stacks`` (a curve belongs to its stacks as much as to its GPUs)."""

    eta_max: float
    n_half: float
    fitted_on: tuple[str, ...] = ()
    stacks: tuple[str, ...] = ()

    def __call__(self, n: float) -> float:
        return self.eta_max * n / (n + self.n_half)


#: The software stacks of the published runs: the training code with its kernels, fusions, overlap and
#: communication tuning, on the cluster it was tuned for.
MEGATRON = "Megatron-LM (NVIDIA)"
LLAMA3_STACK = "Meta's Llama 3 stack"
HAI_LLM = "HAI-LLM (DeepSeek)"

#: One curve per GPU generation, fitted by :func:`calibrate` on the runs of :data:`RECORD`
#: marked ``fit`` (tests/test_planner.py refits them and compares), with those runs' stacks.
KERNEL_CURVES = {
    "Ampere": KernelCurve(0.8761, 4227.8, ("Korthikanti 1T", "Korthikanti 22B"), (MEGATRON,)),
    "Hopper": KernelCurve(0.5728, 1822.2, ("Llama 3 405B, 8,192 GPUs, 8K", "Megatron-Core 7.1B"),
                          (LLAMA3_STACK, MEGATRON)),
}

#: How far two mature stacks have been published apart on the same model and GPUs: MegaScale (Jiang et al.,
#: NSDI 2024, abstract) trains a 175B model on 12,288 GPUs at 55.2% MFU, "1.34×" Megatron-LM's MFU there.
#: A run on a stack no curve was fitted on is predicted as a range, this factor either side (:func:`stack_band`).
STACK_BAND = 1.34
STACK_BAND_SOURCE = ("MegaScale (Jiang et al., NSDI 2024), abstract: a 175B model on 12,288 GPUs at 55.2% MFU, "
                     "1.34× Megatron-LM's")


def stack_band(cluster: Cluster, stack: str | None, efficiency: "float | KernelCurve | None" = None) -> float:
    """The factor either side of a prediction for a run on ``stack``: 1 where the kernel curve in use was
    fitted on that stack (or ``stack`` is None: the curve's own), :data:`STACK_BAND` where it was not. A fixed
    ``efficiency`` (a number) is the caller's own and carries no band."""
    if stack is not None and (not isinstance(stack, str) or not stack):
        raise ValueError(f"stack must name a software stack (a non-empty string) or be None, got {stack!r}")
    if stack is None or (efficiency is not None and not isinstance(efficiency, KernelCurve)):
        return 1.0
    curve = efficiency if isinstance(efficiency, KernelCurve) else KERNEL_CURVES.get(cluster.generation)
    return 1.0 if curve is not None and stack in curve.stacks else STACK_BAND


def gemm_size(m: Model, tp: int = 1, etp: int = 1, moe_layer: bool = False) -> float:
    """``n = sqrt(h · w / t)``: the geometric mean of one GPU's slice of the MLP's first matrix
    (``h × w/t``), the layer's largest product; an MoE layer's is one expert's (split ``etp`` ways)."""
    if moe_layer:
        return math.sqrt(m.hidden * m.moe_ffn / etp)
    return math.sqrt(m.hidden * m.ffn / tp)


def kernel_efficiency(cluster: Cluster, n: float, efficiency: "float | KernelCurve | None" = None) -> float:
    """The cluster's calibrated curve at size ``n``; a :class:`KernelCurve` replaces the curve, a
    number in (0, 1] replaces the efficiency."""
    if isinstance(efficiency, KernelCurve):
        return efficiency(n)
    if efficiency is not None:
        if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must lie in (0, 1], got {efficiency!r}")
        return float(efficiency)
    if cluster.generation not in KERNEL_CURVES:
        raise ValueError(f"no calibrated kernel model for {cluster.generation} GPUs ({cluster.name}): no published "
                         f"run in the planner's record used them; pass efficiency= (a fraction of peak)")
    return KERNEL_CURVES[cluster.generation](n)


# ---------------------------------------------------------------------------- FLOPs

def flops_per_token(m: Model, seq_len: int, recompute: str = "none", modules=()) -> dict:
    """FLOPs one token costs in one training step (forward and backward), by part.

    ``model``: Narayanan et al.'s count — ``72·l·h²·(1 + s/(6h) + V/(12·l·h))`` per token for
    a GPT layer with an MLP of 4h, generalised (6 per active multiply-add parameter; attention's
    two products ``6·s·a·(d_qk + d_v)`` per layer, every key counted). ``hardware``: plus what
    recomputation repeats: the layers' forward pass (full, Narayanan's 96·…) or attention's
    scores and weighted sum, forward (selective, as Korthikanti et al. describe it; their
    eq. 8 adds three times as much).
    """
    _whole(seq_len, "seq_len")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    lp = layer_params(m)
    dqk, dv = m.head_dims
    core = 2 * seq_len * m.heads * (dqk + dv)                                    # forward, one layer, one token
    dense = 2 * (lp["attention"] + lp["mlp"])
    moe_ = 2 * (lp["attention"] + m.top_k * lp["expert"] + lp["shared"] + lp["router"]) if m.is_moe else 0
    layers_fwd = (m.layers - m.moe_layers) * dense + m.moe_layers * moe_
    head = 2 * m.hidden * m.vocab
    model = 3 * (layers_fwd + m.layers * core + head)
    extra = {"none": 0, "selective": m.layers * core, "full": layers_fwd + m.layers * core}[recompute]
    if recompute != "full" and "mla_up_proj" in _check_modules(m, modules):
        extra += m.layers * 2 * _up_projection_params(m)
    return dict(model=model, hardware=model + extra, attention=3 * m.layers * core, head=3 * head)


def narayanan_flops(B: int, s: int, l: int, h: int, V: int, recompute: bool = False) -> float:
    """Narayanan et al. 2021 per iteration: ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``, or with
    full recomputation ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` (their eq. 3)."""
    if recompute:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


# ---------------------------------------------------------------------------- the rules

PIPELINE_LAYOUTS = ("even", "ends")
SCHEDULES = ("1f1b", "dualpipe")
TP_OVERLAP = ("none", "backward", "all")
CP_METHODS = ("ring", "allgather")
CP_LAYOUT = "zigzag"          # the ring's layout, Megatron-LM's (context_parallel.LAYOUTS)


def check_layout(m: Model, c: Cluster, tp=1, sp=False, cp=1, ep=1, pp=1, dp=1, micro_batch=1, seq_len=2048,
                 recompute="none", zero=0, vpp=1, etp=1, pp_layout="even") -> None:
    """Every rule a layout must follow, each a ``ValueError`` naming the numbers.

    Expert parallelism is *folded* (Megatron-Core's MoE parallel folding): the MoE layers
    split the same ``tp·cp·dp`` GPUs of a pipeline stage as expert-tensor × expert × expert-data
    parallelism, so ``etp·ep`` must divide ``tp·cp·dp``; ``ep`` may span the tensor-parallel ranks.
    """
    check_mesh(c.gpus, world="the cluster's GPU count", unit="GPUs", tp=tp, cp=cp, pp=pp, dp=dp)
    for value, what in ((ep, "ep"), (micro_batch, "micro_batch"), (seq_len, "seq_len"), (vpp, "vpp"), (etp, "etp")):
        _whole(value, what)
    if m.heads % tp:
        raise ValueError(f"{m.heads} attention heads are not divisible by tp={tp}")
    if m.kv_heads % tp and tp % m.kv_heads:
        raise ValueError(f"{m.kv_heads} key/value heads and tp={tp}: one must divide the other")
    if m.hidden % tp or (m.ffn % tp) or (m.is_moe and m.moe_ffn % etp):
        raise ValueError(f"the hidden size {m.hidden} and MLP widths must be divisible by tp={tp} (experts: etp={etp})")
    if pp_layout not in PIPELINE_LAYOUTS:
        raise ValueError(f"pp_layout must be one of {PIPELINE_LAYOUTS}, got {pp_layout!r}")
    slots = m.layers + (2 if pp_layout == "ends" else 0)             # "ends": embedding and head take a layer's place
    if pp * vpp > slots:
        raise ValueError(f"pp·vpp = {pp}·{vpp} = {pp * vpp} pipeline stages is more than the model's {m.layers} layers"
                         + (" and its embedding and head" if pp_layout == "ends" else ""))
    if vpp > 1 and pp == 1:
        raise ValueError(f"vpp={vpp} virtual stages need pipeline parallelism (pp > 1)")
    chunks = n_chunks(cp, CP_LAYOUT) if cp > 1 else 1
    if seq_len % chunks:
        raise ValueError(f"seq_len {seq_len} is not divisible by {chunks // cp}·cp = {chunks} "
                         f"({CP_LAYOUT} context parallelism)")
    if sp and (seq_len // cp) % tp:
        raise ValueError(f"sequence parallelism needs tp={tp} to divide the {seq_len // cp} tokens per cp rank")
    if sp and tp == 1:
        raise ValueError("sequence parallelism needs tp > 1")
    if (ep > 1 or etp > 1) and not m.is_moe:
        raise ValueError(f"expert parallelism (ep={ep}, etp={etp}) needs a mixture-of-experts model; {m.name} is dense")
    if m.is_moe and m.experts % ep:
        raise ValueError(f"{m.experts} experts do not split evenly over ep={ep}")
    if (tp * cp * dp) % (etp * ep):
        raise ValueError(f"expert parallelism folds into each stage's tp·cp·dp = {tp * cp * dp} GPUs: etp·ep = "
                         f"{etp}·{ep} = {etp * ep} must divide it")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")


# ---------------------------------------------------------------------------- memory

def model_state_bytes(n_params: float, replicas: int, zero: int = 1, grad_bytes: int = 4,
                      optimizer_bytes: int = 12) -> dict:
    """Weights, gradients and optimizer state of ``n_params`` parameters on one GPU.

    Megatron-LM's count (``theoretical_memory_usage.py``): bf16 weights (2 bytes), fp32
    gradients (4; ``grad_bytes=2`` for bf16), fp32 master weights and two Adam moments (12):
    18 bytes per parameter, ``6 + 12/d`` with the distributed optimizer (``zero=1``) over ``d``
    replicas; ZeRO-2 shards the gradients too, ZeRO-3 the weights (Rajbhandari et al. 2020).
    """
    _whole(replicas, "replicas")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes must be 2 (bf16) or 4 (fp32), got {grad_bytes!r}")
    d = replicas
    return dict(weights=2 * n_params / (d if zero >= 3 else 1),
                gradients=grad_bytes * n_params / (d if zero >= 2 else 1),
                optimizer=optimizer_bytes * n_params / (d if zero >= 1 else 1))


RECOMPUTE_MODULES = ("layernorm", "mla_up_proj", "moe_act")


def _check_modules(m: Model, modules) -> tuple:
    modules = tuple(modules)
    bad = [x for x in modules if x not in RECOMPUTE_MODULES]
    if bad:
        raise ValueError(f"recompute_modules must be among {RECOMPUTE_MODULES}, got {bad}")
    if "mla_up_proj" in modules and (m.moe_config is None or m.moe_config.attention != "mla"):
        raise ValueError(f"recompute_modules 'mla_up_proj' needs multi-head latent attention; {m.name} has none")
    return modules


def layer_activation_terms(m: Model, s: int, b: int, tp: int, sp: bool, recompute: str, moe_layer: bool,
                           fused: bool = True, fp8: bool = False, modules=()) -> dict:
    """One layer's activations on one GPU, in bytes, by tensor: Korthikanti et al.'s terms adjusted.

    Grouped-query attention keeps K and V at ``kv_heads/heads`` of Q's size (MLA: its own
    query·key and value widths, and the two latents its up-projections read); the MLP keeps
    its wide tensors at the real width (GeLU: its input and fc2's input; SwiGLU: gate, up and
    fc2's input); a model without dropout keeps no masks. An MoE layer keeps, per token, the
    router's fp32 scores, ``k`` routed copies of the token (the experts' inputs), their SwiGLU
    tensors and the ``k`` expert outputs the combine weighs, plus the shared experts' tensors;
    with sequence parallelism each tensor-parallel rank routes its ``s/t`` tokens. ``s`` is the
    sequence a GPU holds (``s/cp``). ``fp8``: linear layers keep their inputs in FP8 (1 byte)
    for the weight gradients (DeepSeek-V3 §3.3.3). ``modules`` (Megatron-Core's
    ``--recompute-modules``) drops what is recomputed in the backward pass: ``layernorm`` the
    norms' outputs, ``mla_up_proj`` MLA's Q, K, V (the latents stay), ``moe_act`` the experts'
    SwiGLU output.
    """
    modules = _check_modules(m, modules)
    terms = activation_terms(s, b, m.hidden, m.heads, t=tp, sp=sp, recompute=recompute, fused=fused,
                             dropout=m.dropout)
    if recompute == "full":
        return {k: float(v) for k, v in terms.items()}
    e = 2
    linear_e = 1 if fp8 else e                                  # what a linear layer keeps of its input
    for name in ("q|k|v input", "fc1 input"):
        terms[name] = 0.0 if "layernorm" in modules else terms[name] * linear_e / e
    c = m.moe_config
    tokens = s * b / tp                                                               # per head group on this rank
    if c is not None and c.attention == "mla":
        dqk, dv = m.head_dims
        terms["latents"] = s * b * (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim) * e
        terms["Q and K"] = 0.0 if "mla_up_proj" in modules else tokens * m.heads * dqk * 2 * e
        terms["V"] = 0.0 if "mla_up_proj" in modules else tokens * m.heads * dv * e
        terms["projection input"] = tokens * m.heads * dv * linear_e
    else:
        sbh = tokens * m.hidden * e                                                    # one (s, b, h/t) tensor
        kv = m.kv_heads / m.heads
        terms["Q and K"] = sbh * (1 + kv)
        terms["V"] = sbh * kv
        terms["projection input"] = terms["projection input"] * linear_e / e
    for name in ("GeLU input", "fc2 input"):
        terms.pop(name, None)
    wide = (m.mlp_matrices - 1) * e + linear_e               # GeLU's or SwiGLU's inputs, and fc2's input
    if not moe_layer:
        terms["MLP wide tensors"] = s * b * m.ffn / tp * wide
        return {k: float(v) for k, v in terms.items()}
    rank_tokens = s * b / (tp if sp else 1)
    k = m.top_k
    expert_wide = (m.mlp_matrices - 1) * e + (0 if "moe_act" in modules else linear_e)
    terms["router scores"] = rank_tokens * m.experts * 4
    terms["routed copies"] = rank_tokens * k * m.hidden * linear_e
    terms["expert wide tensors"] = rank_tokens * k * m.moe_ffn * expert_wide
    terms["expert outputs"] = rank_tokens * k * m.hidden * e
    terms["shared expert wide tensors"] = s * b * m.shared_experts * m.moe_ffn * wide / tp
    return {k: float(v) for k, v in terms.items()}


def layer_activation_bytes(m: Model, s: int, b: int, tp: int, sp: bool, recompute: str, moe_layer: bool,
                           fused: bool = True, fp8: bool = False, modules=()) -> float:
    """The sum of :func:`layer_activation_terms`."""
    return float(sum(layer_activation_terms(m, s, b, tp, sp, recompute, moe_layer, fused, fp8, modules).values()))


# ---------------------------------------------------------------------------- communication helpers

def expected_nodes(experts: int, nodes: int, k: int, limit: int | None = None) -> float:
    """Distinct nodes a token's ``k`` experts sit on, chosen at random among ``experts`` spread
    evenly over ``nodes`` (chapter 06): ``nodes·(1 − C(E − E/nodes, k)/C(E, k))``, at most ``limit``."""
    for value, what in ((experts, "experts"), (nodes, "nodes"), (k, "k")):
        _whole(value, what)
    if experts % nodes:
        raise ValueError(f"{experts} experts do not spread evenly over {nodes} nodes")
    if k > experts:
        raise ValueError(f"k={k} experts per token is more than the {experts} experts")
    spread = nodes * (1 - math.comb(experts - experts // nodes, k) / math.comb(experts, k))
    return min(spread, limit) if limit else spread


def ring_bandwidth(c: Cluster, stride: int, group: int) -> float:
    """Bytes/s per GPU of a ring collective over ``group`` ranks placed ``stride`` GPUs apart.

    Inside one node: the NVLink figure. Across nodes, a ring crosses each node boundary once
    and the node's ``k`` members of the group share its ``k`` NICs, so each member's data
    leaves at ``k`` times one NIC's rate, at most the NVLink rate (NCCL spreads its rings over
    the node's NICs).
    """
    per_node = max(1, c.gpus_per_node // stride)
    if group <= per_node:
        return c.intra
    return min(c.intra, per_node * c.inter)


def group_nodes(c: Cluster, stride: int, group: int) -> int:
    """How many nodes a group of ``group`` ranks placed ``stride`` GPUs apart spans (ranks 0, stride, 2·stride, …)."""
    return len({i * stride // c.gpus_per_node for i in range(group)})


def ddp_bucket_elements(replicas: int) -> int:
    """Megatron-LM's default gradient bucket: ``max(4·10⁷, 10⁶·d)`` elements for ``d`` data- (and
    context-) parallel ranks (``resolve_ddp_bucket_size`` in megatron/training/training.py): larger
    buckets at large ``d`` keep NCCL's rings bandwidth-bound rather than latency-bound."""
    return max(40_000_000, 1_000_000 * replicas)


def bucketed(op: str, elements: float, itemsize: int, replicas: int, nodes: int, bandwidth: float,
             latency: bool = True, overlapped: bool = True, bucket: int | None = None,
             net_overhead_us: float = 1.0) -> tuple:
    """(seconds for all buckets, seconds of one bucket, buckets, NCCL's algorithm) for ``elements``
    reduced or gathered in Megatron's buckets, each costed by NCCL's model (:func:`.collectives.nccl_time`).
    Not ``overlapped``, one bucket: Megatron-LM buckets only with ``--overlap-grad-reduce``. ``bucket``
    (elements) defaults to :func:`ddp_bucket_elements` of ``replicas``.
    ``latency=False``: the ring's bandwidth term alone, and no bucket left exposed (the planner before
    it modelled NCCL, kept for the comparison in chapter 08)."""
    if replicas == 1 or elements <= 0:
        return 0.0, 0.0, 0, ""
    bucket = ddp_bucket_elements(replicas) if bucket is None else bucket
    buckets = max(1, math.ceil(elements / bucket)) if overlapped else 1
    if not latency:
        return bus_factor(op, replicas) * elements * itemsize / bandwidth, 0.0, buckets, "ring"
    each, algorithm = nccl_time(op, elements / buckets * itemsize, replicas, nodes, bandwidth,
                                net_overhead_us=net_overhead_us)
    return buckets * each, each, buckets, algorithm


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normal samples], by quadrature: 0 for one, 0.56 for two,
    about 3.9 for 10⁴ (it grows like ``√(2 ln n)``, more slowly at first)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a whole number ≥ 1")
    if n == 1:
        return 0.0
    step, total = 0.002, 0.0
    for i in range(-6000, 6001):                   # x from −12 to 12: E[max] = ∫ x · n φ(x) Φ(x)^(n−1) dx
        x = i * step
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * math.erfc(-x / math.sqrt(2))
        total += x * n * phi * cdf ** (n - 1) * step
    return total


def _stage_layers(m: Model, pp: int, layout: str) -> list[tuple[int, int, bool]]:
    """Per pipeline rank: (dense layers, MoE layers, holds the output head), layers in order.

    ``even``: the layers split as evenly as they go, the first ranks taking one more when
    ``pp`` does not divide them (Megatron-LM's default); the output head rides on the last rank.
    ``ends``: the input embedding and the output head each take the place of one layer, so the
    first and last ranks hold one layer fewer (Llama 3's balancing).
    """
    slots = m.layers + (2 if layout == "ends" else 0)
    counts = [slots // pp + (1 if r < slots % pp else 0) for r in range(pp)]
    if layout == "ends":
        counts[0] -= 1
        counts[-1] -= 1
        if min(counts) < 0:
            raise ValueError(f"pp={pp} stages leave the first or last with no room for the embedding or head")
    out, start = [], 0
    for r, n in enumerate(counts):
        dense = max(0, min(start + n, m.dense_layers if m.is_moe else m.layers) - start)
        out.append((dense, n - dense, r == pp - 1))
        start += n
    return out


# ---------------------------------------------------------------------------- the plan

class _Summed:
    """``total`` and ``parts()`` for a result whose components are the class's ``LABELS`` (field → label)."""

    LABELS: dict = {}

    @property
    def total(self) -> float:
        return sum(getattr(self, f) for f in self.LABELS)

    def parts(self) -> tuple[tuple[str, float], ...]:
        """(label, value) for every component, in the order :attr:`total` adds them."""
        return tuple((label, getattr(self, f)) for f, label in self.LABELS.items())


@dataclass(frozen=True)
class StepTime(_Summed):
    """One step's time on the slowest pipeline stage, in seconds, by component: the ``m`` micro-batches'
    compute, the pipeline bubble, each strategy's communication left exposed, and the wait for the slowest
    GPU (``stragglers``); :attr:`total` adds them up."""

    compute: float
    bubble: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    pp_comm: float
    dp_comm: float
    stragglers: float

    #: Each field with the label the chapter's charts print.
    LABELS = {"compute": "compute", "bubble": "bubble", "tp_comm": "tp comm", "cp_comm": "cp comm",
              "ep_comm": "ep comm", "pp_comm": "pp comm", "dp_comm": "dp comm", "stragglers": "stragglers"}


@dataclass(frozen=True)
class Memory(_Summed):
    """Bytes per GPU of the first pipeline stage, by component (:func:`stage_memory`), and the GPU's
    ``capacity``; :attr:`total` adds the components up."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    capacity: float

    #: The components :attr:`total` adds, with the labels the chapter prints.
    LABELS = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer", "activations": "activations"}


@dataclass(frozen=True)
class CommBytes(_Summed):
    """Bytes one GPU sends per step, by strategy; :attr:`total` adds them up."""

    tp: float
    cp: float
    ep: float
    pp: float
    dp: float

    LABELS = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": "dp"}


@dataclass(frozen=True)
class CrossesNodes:
    """For each strategy's group, whether it leaves the fast domain (:attr:`Layout.crosses_nodes`)."""

    tp: bool
    cp: bool
    ep: bool
    pp: bool
    dp: bool

    def parts(self) -> tuple[tuple[str, bool], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step (all GPUs together): the model's count (MFU's numerator) and the hardware's, which
    adds what recomputation repeats (HFU's)."""

    model: float
    hardware: float


@dataclass(frozen=True)
class Efficiency:
    """The fraction of peak the kernel curve gives the dense layers, the MoE layers (None for a dense
    model) and the output head."""

    dense: float
    moe: float | None
    head: float


@dataclass
class Plan:
    """Per GPU: memory by component (:class:`Memory`), bytes sent per step by strategy (:class:`CommBytes`),
    which groups leave the node (:class:`CrossesNodes`), the time estimate (:class:`StepTime`), the step's
    FLOPs (:class:`StepFlops`) and the kernel curve's efficiencies (:class:`Efficiency`).

    ``stack`` is the software stack asked about (None: the kernel curve's own) and ``band`` the factor either
    side of the prediction that the stack leaves open (:func:`stack_band`; 1 on a fitted stack):
    :attr:`mfu_range`, :attr:`hfu_range` and :attr:`time_range` are the predicted ranges."""

    memory_bytes: Memory
    comm_bytes: CommBytes
    crosses_nodes: CrossesNodes
    time: StepTime
    mfu: float
    hfu: float
    gpus: int
    flops: StepFlops
    efficiency: Efficiency
    micro_batches: int
    ep_hidden_behind: str = ""      # what the all-to-alls overlap with ("" when they are not overlapped)
    comm_sms: int = 0               # the SMs charged to communication
    dp_algorithm: str = ""          # NCCL's choice for the gradients' buckets: "ring" or "tree" ("" without dp)
    stack: str | None = None        # the software stack asked about (None: the kernel curve's own)
    band: float = 1.0               # the factor either side of the prediction the stack leaves open

    @property
    def fits(self) -> bool:
        return self.memory_bytes.total <= self.memory_bytes.capacity

    @property
    def mfu_range(self) -> tuple[float, float]:
        """(low, high) MFU: the prediction divided and multiplied by :attr:`band`."""
        return self.mfu / self.band, self.mfu * self.band

    @property
    def hfu_range(self) -> tuple[float, float]:
        return self.hfu / self.band, self.hfu * self.band

    @property
    def time_range(self) -> tuple[float, float]:
        """(fastest, slowest) seconds per step on the stack."""
        return self.time.total / self.band, self.time.total * self.band


#: SMs the overlapped all-to-alls take from computation while they run, by default: DeepSeek-V3's 20 of
#: the H800's 132 (§3.2.2), for its own dispatch kernels. An assumption for any other stack (NCCL's
#: all-to-all uses its own channel count).
EP_COMM_SMS = 20
_DUALPIPE = "DualPipe's chunk pair: another micro-batch's forward or backward (DeepSeek-V3 §3.2.1)"
_COMBINED = ("combined 1F1B: an adjacent micro-batch's forward or backward (Megatron-Core's "
             "--overlap-moe-expert-parallel-comm)")
_SHARED = ("the shared experts only (Megatron-Core's --moe-shared-expert-overlap): no second micro-batch in "
           "flight, or full recomputation, which Megatron-Core refuses with combined 1F1B")
_NOTHING = "nothing: no shared expert and no second micro-batch in flight (the all-to-alls are exposed)"


def ep_overlap_partner(m: Model, ep: int, pp: int, vpp: int, schedule: str, micro_batches: int,
                       recompute: str = "none") -> str:
    """What an overlapped all-to-all can hide behind, in words ("" without expert parallelism).

    Within one micro-batch the all-to-alls sit on the critical path (router → dispatch → experts →
    combine → next layer); the planner models only the independent work that hides them:
    DualPipe pairs one micro-batch's forward chunk with another's backward; Megatron-Core's
    combined 1F1B does the same for adjacent micro-batches, with one pipeline stage or with
    virtual stages (it asserts them when pp > 1) and without full recomputation (it asserts
    that too: transformer_config.py); with neither, only the shared experts, which do not wait
    for the dispatch. Not modelled: the weight-gradient products of the backward, which need not
    wait for the dispatch's gradient (DeepSeek-V3 splits the backward for this; Megatron-Core's
    --delay-wgrad-compute), and token-chunked pipelining inside one micro-batch.
    """
    if ep == 1 or not m.is_moe:
        return ""
    if schedule == "dualpipe":
        return _DUALPIPE
    if micro_batches >= 2 and (pp == 1 or vpp > 1) and recompute != "full":
        return _COMBINED
    return _SHARED if m.shared_experts else _NOTHING


def paired_fraction(partner: str, pp: int, micro_batches: int) -> float:
    """The share of micro-batches whose all-to-alls run beside another micro-batch's work.

    Only the steady state pairs a forward with a backward: Megatron-Core's combined 1F1B without a
    pipeline runs the first forward and the last backward alone (m − 1 of m paired); with a pipeline
    (interleaved 1F1B, or DualPipe's steps 1–3 and 6–8) the warm-up and cool-down run unpaired,
    which the planner approximates as pp micro-batches of the m (an approximation, not a count of
    either schedule's chunks).
    """
    if partner not in (_DUALPIPE, _COMBINED):
        return 0.0
    unpaired = 1 if pp == 1 else pp
    return max(0.0, (micro_batches - unpaired) / micro_batches)


@dataclass(frozen=True)
class Layout:
    """A layout of ``model`` on ``cluster``, with every option of :func:`plan`, checked when it is made
    (each broken rule a ``ValueError`` naming it), and what follows from it. The planner's pieces
    (:func:`stage_memory`, :func:`layer_time`, :func:`tp_cost`, :func:`cp_cost`, :func:`ep_cost`,
    :func:`pipeline_cost`, :func:`dp_cost`) each take one; :func:`plan` adds them up."""

    model: Model
    cluster: Cluster
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    seq_len: int = 2048
    recompute: str = "none"
    zero: int = 0
    global_batch: int | None = None
    vpp: int = 1
    efficiency: "float | KernelCurve | None" = None
    etp: int = 1
    fused: bool = True
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    fp8: bool = False
    tp_overlap: str = "backward"
    dp_overlap: bool = True
    cp_method: str = "ring"
    dedup: bool = False
    node_limit: int | None = None
    ep_overlap: bool | str = False
    comm_sms: int | None = None
    ep_imbalance: float = 1.0
    schedule: str = "1f1b"
    pp_layout: str = "even"
    recompute_modules: tuple = ()
    vpp_group: int | None = None
    attention_efficiency: float | None = None
    straggler_sigma: float = 0.0
    dp_latency: bool = True
    stack: str | None = None

    def __post_init__(self):
        m, c, pp, vpp, dp, mbs = self.model, self.cluster, self.pp, self.vpp, self.dp, self.micro_batch
        check_layout(m, c, self.tp, self.sp, self.cp, self.ep, pp, dp, mbs, self.seq_len, self.recompute, self.zero,
                     vpp, self.etp, self.pp_layout)
        for value, allowed, what in ((self.schedule, SCHEDULES, "schedule"), (self.tp_overlap, TP_OVERLAP, "tp_overlap"),
                                     (self.cp_method, CP_METHODS, "cp_method")):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {allowed}, got {value!r}")
        if self.schedule == "dualpipe" and (pp % 2 or vpp > 1):
            raise ValueError(f"DualPipe needs an even number of stages and no virtual stages (pp={pp}, vpp={vpp})")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"grad_bytes must be 2 (bf16) or 4 (fp32), got {self.grad_bytes!r}")
        _whole(self.optimizer_bytes, "optimizer_bytes", minimum=0)
        if self.node_limit is not None:
            _whole(self.node_limit, "node_limit")
        if self.tp_overlap == "all" and self.tp > 1 and not self.sp:
            raise ValueError("tp_overlap='all' overlaps reduce-scatters and all-gathers with their products: it needs "
                             "sequence parallelism (sp=True), as Megatron-LM's --tp-comm-overlap asserts")
        a = self.attention_efficiency
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a <= 1):
            raise ValueError(f"attention_efficiency must lie in (0, 1], got {a!r}")
        if self.fp8 and not c.fp8_peak:
            raise ValueError(f"{c.name} has no FP8 peak: fp8=True needs FP8 tensor cores")
        imb = self.ep_imbalance
        if isinstance(imb, bool) or not isinstance(imb, (int, float)) or not 1 <= imb < math.inf:
            raise ValueError(f"ep_imbalance is the busiest rank's tokens over the mean, at least 1; got {imb!r}")
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", dp * mbs * max(pp, 8))
        _whole(self.global_batch, "global_batch")
        if self.global_batch % (dp * mbs):
            raise ValueError(f"global batch {self.global_batch} is not a whole number of micro-batches of {mbs} "
                             f"on each of dp={dp} replicas")
        s = self.straggler_sigma
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1:
            raise ValueError(f"straggler_sigma is a spread relative to the mean step, in [0, 1); got {s!r}")
        if self.ep_overlap not in (True, False, "auto"):
            raise ValueError(f"ep_overlap must be True, False or 'auto', got {self.ep_overlap!r}")
        mb = self.micro_batches
        partner = ep_overlap_partner(m, self.ep, pp, vpp, self.schedule, mb, self.recompute) if self.ep_overlap else ""
        if self.ep_overlap == "auto" and partner == _NOTHING:
            partner = ""
        object.__setattr__(self, "partner", partner)
        if self.comm_sms is None:
            object.__setattr__(self, "comm_sms", EP_COMM_SMS if partner else 0)
        _whole(self.comm_sms, "comm_sms", minimum=0)
        if self.comm_sms >= c.sms:
            raise ValueError(f"comm_sms={self.comm_sms} leaves none of the GPU's {c.sms} SMs for computation")
        if pp > 1 and mb < pp and self.schedule == "1f1b" and vpp == 1:
            raise ValueError(f"{mb} micro-batches per replica cannot fill pp={pp} pipeline stages")
        if self.vpp_group is not None:
            _whole(self.vpp_group, "vpp_group")
            if vpp == 1:
                raise ValueError(f"vpp_group={self.vpp_group} groups micro-batches per virtual stage: it needs vpp > 1")
        if self.schedule == "dualpipe" and (mb % 2 or mb < 2 * pp):
            raise ValueError(f"DualPipe feeds micro-batches from both ends, an even number and at least 2·pp = "
                             f"{2 * pp} (DeepSeek's dualpipe.py asserts both): {mb} per replica")
        object.__setattr__(self, "modules", _check_modules(m, self.recompute_modules))
        object.__setattr__(self, "band", stack_band(c, self.stack, self.efficiency))

    @property
    def micro_batches(self) -> int:
        """``m``, the micro-batches each replica runs per step."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """The experts' data-parallel degree: what of ``tp·cp·dp`` expert-tensor × expert parallelism leaves."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def tokens(self) -> int:
        """``N``: the tokens of one micro-batch a GPU holds (its ``s/cp`` of each sequence)."""
        return self.seq_len // self.cp * self.micro_batch

    @property
    def stages(self) -> list[tuple[int, int, bool]]:
        return _stage_layers(self.model, self.pp, self.pp_layout)

    @property
    def copies(self) -> int:
        """Model chunks per GPU whose weights it holds: 2 under DualPipe (both ends of the pipeline), else 1."""
        return 2 if self.schedule == "dualpipe" else 1

    @property
    def crosses_nodes(self) -> CrossesNodes:
        """Which groups leave the fast domain (Megatron's order: tp, cp, [ep inside tp·cp·dp], dp, pp)."""
        g, tp, cp, dp = self.cluster.gpus_per_node, self.tp, self.cp, self.dp
        return CrossesNodes(tp=tp > g, cp=cp > 1 and tp * cp > g, ep=self.ep > 1 and self.etp * self.ep > g,
                            dp=dp * cp > 1 and tp * cp * dp > g, pp=self.pp > 1 and tp * cp * dp * self.pp > g)

    def bandwidth(self, group: str) -> float:
        """Bytes/s per GPU for ``group``'s traffic: NVLink or the network, and for data parallelism a ring over
        nodes whose NICs serve the node's members together (:func:`ring_bandwidth`)."""
        if group == "dp":
            return ring_bandwidth(self.cluster, self.tp, self.dp * self.cp)
        return self.cluster.inter if getattr(self.crosses_nodes, group) else self.cluster.intra


@dataclass(frozen=True)
class Cost:
    """One strategy's communication per GPU: bytes sent, and seconds not hidden behind computation."""

    sent: float
    exposed: float


@dataclass(frozen=True)
class LayerTime:
    """One layer's compute for one micro-batch on one GPU, in seconds: ``fwd``, ``bwd`` (2·fwd), what
    recomputation repeats (``again``), attention's core products (``core``) and the shared experts'
    forward and backward (``shared``, what can run beside an un-paired all-to-all)."""

    fwd: float
    bwd: float
    again: float
    core: float
    shared: float

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.again


def stage_params(lay: Layout) -> tuple[float, float]:
    """(dense, expert) parameters per GPU of the first stage (or, at ``pp = 1``, all, with both tables)."""
    m, tp = lay.model, lay.tp
    lp = layer_params(m)
    first_dense, first_moe, _ = lay.stages[0]
    tables = 2 if lay.pp == 1 else 1
    dense = ((first_dense + first_moe) * lp["attention"] + first_dense * lp["mlp"]
             + first_moe * (lp.get("shared", 0))) / tp + tables * m.vocab * m.hidden / tp \
        + (first_dense + first_moe) * lp["norms"] + first_moe * lp.get("router", 0)
    return dense, first_moe * lp.get("experts", 0) / (lay.etp * lay.ep)


def stage_memory(lay: Layout) -> Memory:
    """Bytes per GPU of the first stage (the embedding, the most activations in flight) by component:
    Megatron-LM's model states, Korthikanti et al.'s activations times the micro-batches in flight."""
    m, pp, vpp, mb, N = lay.model, lay.pp, lay.vpp, lay.micro_batches, lay.tokens
    dense_params, expert_params = stage_params(lay)
    dense_state = model_state_bytes(lay.copies * dense_params, lay.dp * lay.cp, lay.zero, lay.grad_bytes,
                                    lay.optimizer_bytes)
    expert_state = model_state_bytes(lay.copies * expert_params, lay.edp, lay.zero, lay.grad_bytes,
                                     lay.optimizer_bytes)
    s_loc = lay.seq_len // lay.cp
    per = [layer_activation_bytes(m, s_loc, lay.micro_batch, lay.tp, lay.sp, lay.recompute, moe_layer, lay.fused,
                                  lay.fp8, lay.modules) if (m.is_moe or not moe_layer) else 0.0
           for moe_layer in (False, True)]
    first_dense, first_moe, _ = lay.stages[0]
    stage_acts = first_dense * per[0] + first_moe * per[1]
    if lay.schedule == "dualpipe":
        in_flight = (pp + 1) * lay.copies / 2      # DeepSeek-V3 Table 2: PP + 1 micro-batches of a chunk (1F1B: PP)
    elif vpp > 1:                         # Megatron-LM's interleaved warm-up on the first rank, in model chunks
        group = pp if lay.vpp_group is None else lay.vpp_group
        in_flight = min(mb * vpp, 2 * (pp - 1) + (vpp - 1) * group + 1) / vpp
    else:
        in_flight = min(pp, mb)
    activations = stage_acts * in_flight
    if pp == 1:                                                                           # logits (fp32) and their input
        activations += 4 * N * (m.hidden + m.vocab) / lay.tp
    return Memory(**{k: dense_state[k] + expert_state[k] for k in dense_state}, activations=activations,
                  capacity=lay.cluster.memory)


def gemm_seconds(lay: Layout, flops: float, n: float) -> float:
    """Matrix products at η_max of their peak, and the rest of the layer's kernels (n_half/n of that time, at
    the bf16 rate): FP8 speeds up only the products. A fixed ``efficiency`` runs everything at it."""
    c, eff = lay.cluster, lay.efficiency
    if eff is None or isinstance(eff, KernelCurve):
        curve = eff if isinstance(eff, KernelCurve) else KERNEL_CURVES[c.generation]
        return flops / curve.eta_max * (1 / (c.fp8_peak if lay.fp8 else c.peak) + curve.n_half / n / c.peak)
    return flops / ((c.fp8_peak if lay.fp8 else c.peak) * eff)


def layer_size(lay: Layout, moe_layer: bool) -> float:
    """The matrix size the kernel curve reads for a layer (:func:`gemm_size`)."""
    m = lay.model
    return gemm_size(m, lay.tp, lay.etp, True) if (moe_layer and m.is_moe) else gemm_size(m, lay.tp)


def layer_time(lay: Layout, moe_layer: bool = False) -> LayerTime:
    """One layer's compute per micro-batch on one GPU (an MoE layer: its ``k`` routed experts, scaled by
    ``ep_imbalance``, its shared experts and router)."""
    m, N, tp = lay.model, lay.tokens, lay.tp
    lp = layer_params(m)
    dqk, dv = m.head_dims
    n = layer_size(lay, moe_layer)
    eta = kernel_efficiency(lay.cluster, n, lay.efficiency)
    causal = 0.5 if lay.fused else 1.0                            # a fused kernel skips the masked half
    core_f = 2 * N * lay.seq_len * m.heads * (dqk + dv) / tp * causal                   # scores + weighted sum
    shared = 0.0
    if moe_layer:
        mlp_f = 2 * N * (m.top_k * lp["expert"] * lay.ep_imbalance + lp["shared"] + lp["router"]) / tp
        shared = 3 * gemm_seconds(lay, 2 * N * lp["shared"] / tp, n)                  # forward and backward
    else:
        mlp_f = 2 * N * lp["mlp"] / tp
    gemm = gemm_seconds(lay, 2 * N * lp["attention"] / tp + mlp_f, n)
    core = core_f / (lay.cluster.peak * (eta if lay.attention_efficiency is None else lay.attention_efficiency))
    fwd = gemm + core
    again = {"none": 0.0, "selective": core, "full": fwd}[lay.recompute]
    if lay.recompute != "full" and "mla_up_proj" in lay.modules:
        again += gemm_seconds(lay, 2 * N * _up_projection_params(m) / tp, n)
    return LayerTime(fwd, 2 * fwd, again, core, shared)


def head_time(lay: Layout) -> tuple[float, float]:
    """(seconds of the output head forward and backward per micro-batch, its efficiency): kept in bf16, as
    DeepSeek-V3 keeps it."""
    m = lay.model
    eta = kernel_efficiency(lay.cluster, math.sqrt(m.hidden * m.vocab / lay.tp), lay.efficiency)
    return 3 * 2 * lay.tokens * m.hidden * m.vocab / lay.tp / (lay.cluster.peak * eta), eta


def tp_products(lay: Layout, moe_layer: bool = False) -> list[float]:
    """Forward seconds of the matrix products beside which each tensor-parallel collective of a layer runs
    under ``tp_overlap="all"``: the gather before a column-parallel product feeds it, the reduction after a
    row-parallel one follows it (Transformer Engine's userbuffers overlap, chapter 07) — attention's
    q·k·v and output projections, then the MLP's first matrices and its last (an MoE layer with whole
    experts: attention's only; with split experts, none for theirs)."""
    m, N, tp = lay.model, lay.tokens, lay.tp
    lp = layer_params(m)
    n = layer_size(lay, moe_layer)
    out_attn = m.heads * m.head_dims[1] * m.hidden
    pieces = [lp["attention"] - out_attn, out_attn]
    if not moe_layer:
        pieces += [lp["mlp"] * (m.mlp_matrices - 1) / m.mlp_matrices, lp["mlp"] / m.mlp_matrices]
    elif lay.etp > 1:          # split experts: their collectives run in the token dispatcher, outside TE's
        pieces += [0.0, 0.0]   # userbuffers, so nothing hides them here
    return [gemm_seconds(lay, 2 * N * p / tp, n) for p in pieces]


def tp_cost(lay: Layout, L: LayerTime, moe_layer: bool = False) -> Cost:
    """Tensor parallelism per layer and micro-batch: the all-reduces of ``s·b·h`` (two forward and two
    backward; an MoE layer with whole experts has attention's pair only; full recomputation repeats the
    forward's) — with sequence parallelism a reduce-scatter and an all-gather each, and in the backward one
    more all-gather per column-parallel layer, which re-gathers the input its weight gradient needs
    (Megatron-LM's layout, chapter 03: 1.5× the bytes backward). Exposed as ``tp_overlap`` says: all of
    them (``"none"``); the forward's, the backward's pair hidden behind the weight gradients and the
    re-gathers behind the input gradients (``"backward"``); or each reduce-scatter and all-gather behind the
    one product beside it, as Transformer Engine's userbuffers overlap runs them (``"all"``,
    :func:`tp_products`): forward, each behind its product; backward, a row-parallel layer's all-gather of
    the output gradient beside its input-gradient product only (its weight gradient needs what it gathers),
    a column-parallel layer's re-gather behind its input-gradient product and its reduce-scatter behind its
    weight-gradient product."""
    tp, e = lay.tp, 2
    if tp == 1:
        return Cost(0.0, 0.0)
    pairs = 1 if (moe_layer and lay.etp == 1) else 2
    one = bus_factor("all_reduce", tp) * lay.tokens * lay.model.hidden * e
    regather = pairs * one / 2 if lay.sp else 0.0        # one all-gather of s·b·h per column-parallel layer
    bw = lay.bandwidth("tp")
    fwd_c = pairs * one / bw
    passes = 3 if lay.recompute == "full" else 2
    if lay.tp_overlap == "none":
        exposed = passes * fwd_c + regather / bw
    elif lay.tp_overlap == "backward":
        exposed = (passes - 1) * fwd_c + max(0.0, fwd_c - L.bwd / 2) + max(0.0, regather / bw - L.bwd / 2)
    else:
        half = one / bw / 2                                  # a reduce-scatter or an all-gather: half an all-reduce
        products = tp_products(lay, moe_layer)               # column, row, column, row
        forward = sum(max(0.0, half - t) for t in products)
        backward = sum((2 if k % 2 == 0 else 1) * max(0.0, half - t) for k, t in enumerate(products))
        exposed = (passes - 1) * forward + backward
    return Cost(passes * pairs * one + regather, exposed)


def cp_cost(lay: Layout, L: LayerTime) -> Cost:
    """Context parallelism per layer and micro-batch: the ring's ``K``, ``V`` blocks hidden where a step's
    attention covers them (chapter 04), or Llama 3's all-gather of ``K``, ``V`` exposed."""
    cp, m, e = lay.cp, lay.model, 2
    if cp == 1:
        return Cost(0.0, 0.0)
    dqk = m.head_dims[0]
    kv_local = max(m.kv_heads // lay.tp, 1)
    bw = lay.bandwidth("cp")
    if lay.cp_method == "allgather":                                    # K, V gathered; dK, dV reduce-scattered
        sent = 2 * (cp - 1) * 2 * lay.micro_batch * (lay.seq_len // cp) * kv_local * dqk * e
        return Cost(sent, sent / bw * (1.5 if lay.recompute == "full" else 1.0))
    costs = cp_costs(lay.seq_len, lay.micro_batch, kv_local, dqk, cp, "ring", causal=True, layout=CP_LAYOUT,
                     itemsize=e)
    steps = cp - 1
    fwd = max(0.0, costs["forward"] / steps / bw - L.core / cp) * steps
    bwd = max(0.0, costs["backward"] / steps / bw - 2 * L.core / cp) * steps
    return Cost(costs["sent"], fwd + bwd)


def ep_cost(lay: Layout, L: LayerTime) -> Cost:
    """Expert parallelism per MoE layer and micro-batch: dispatch and combine, forward and backward, one copy
    per assignment or one per destination node (``dedup``), exposed but for what runs beside it."""
    ep, m, c = lay.ep, lay.model, lay.cluster
    if ep == 1:
        return Cost(0.0, 0.0)
    e, h = 2, m.hidden
    per_node = max(1, min(ep, c.gpus_per_node // lay.etp))
    nodes = ep // per_node if ep % per_node == 0 else math.ceil(ep / per_node)
    k = m.top_k
    if lay.dedup and nodes > 1:                # one copy per remote node, then NVLink to the experts' GPUs
        ib_copies = expected_nodes(m.experts, nodes, k, lay.node_limit) * (nodes - 1) / nodes
        nv_copies = k * (per_node - 1) / per_node
    else:                                      # one copy per assignment that leaves the GPU
        ib_copies = k * (ep - per_node) / ep
        nv_copies = k * (per_node - 1) / ep
    rank_tokens = lay.tokens / (lay.tp if lay.sp else 1)                               # what an MoE layer routes
    unit = rank_tokens * h * ((1 if lay.fp8 else e) + 3 * e)    # dispatch, combine; their gradients backward
    ib, nv = unit * ib_copies / c.inter, unit * nv_copies / c.intra
    t_comm = (max(ib, nv) if lay.dedup else ib + nv) * lay.ep_imbalance   # node-aware kernels use both at once
    share = 1 - lay.comm_sms / c.sms            # of the SMs, while an overlapped all-to-all runs

    def exposed(hidden: float) -> float:
        """While the all-to-all runs (t_comm), computation has ``share`` of the SMs: with t_comm·share of
        work to do meanwhile it hides the transfer but for t_comm·(1 − share); with less, the rest shows."""
        return t_comm - min(hidden, t_comm * share)

    alone = exposed(L.shared if lay.partner else 0.0)
    paired = paired_fraction(lay.partner, lay.pp, lay.micro_batches)    # another micro-batch meanwhile
    return Cost(unit * (ib_copies + nv_copies), paired * exposed(L.total) + (1 - paired) * alone)


def pipeline_cost(lay: Layout, t_mb: float) -> tuple[float, Cost]:
    """(the bubble, the point-to-point traffic per micro-batch) for a pipeline whose slowest stage takes
    ``t_mb`` per micro-batch: ``(pp−1)/vpp`` micro-batches' time (interleaved 1F1B) or DualPipe's
    ``(pp/2−1)(F&B + B − 3W)``; one activation each way per stage boundary, ``vpp`` times interleaved."""
    pp = lay.pp
    if pp == 1:
        return 0.0, Cost(0.0, 0.0)
    sent = 2 * lay.tokens * lay.model.hidden * 2 / (lay.tp if lay.sp else 1) * lay.vpp
    if lay.schedule == "dualpipe":
        return (pp / 2 - 1) * (2 / 3) * t_mb, Cost(sent, 0.0)   # F&B ≈ F + B, B = 2F, W = F
    return (pp - 1) / lay.vpp * t_mb, Cost(sent, sent / lay.bandwidth("pp"))


def dp_cost(lay: Layout, fwd: float, bwd: float) -> tuple[Cost, str]:
    """(data parallelism per step, NCCL's algorithm for its gradient buckets) for the fullest stage, whose
    micro-batch takes ``fwd`` and ``bwd`` seconds: gradients reduce-scattered (ZeRO ≥ 1) or all-reduced, the
    weights gathered with ZeRO, in Megatron-LM's buckets over the group's real size and nodes; ZeRO-2 and
    ZeRO-3 reduce every micro-batch's gradients, ZeRO-3 gathers the weights for each forward and backward."""
    c, zero, e, mb = lay.cluster, lay.zero, 2, lay.micro_batches
    replicas, edp = lay.dp * lay.cp, lay.edp
    dense, experts = stage_params(lay)
    grads_dense, grads_exp = dense * lay.copies, experts * lay.copies
    reduce_op = "reduce_scatter" if zero >= 1 else "all_reduce"
    rs = bus_factor(reduce_op, replicas) * grads_dense * lay.grad_bytes + \
        bus_factor(reduce_op, edp) * grads_exp * lay.grad_bytes
    ag = bus_factor("all_gather", replicas) * grads_dense * e + bus_factor("all_gather", edp) * grads_exp * e \
        if zero >= 1 else 0.0
    # Each in Megatron's buckets, each bucket costed by NCCL's model over the group's real size and nodes
    # (latency included: it grows with the ring, logarithmically on a tree); the experts' gradients over
    # their own, smaller data-parallel group (its ranks placed etp·ep apart), in buckets of the same size
    # (Megatron-LM sizes every buffer's buckets from the data- and context-parallel size).
    dp_nodes, edp_nodes = group_nodes(c, lay.tp, replicas), group_nodes(c, lay.etp * lay.ep, edp)
    bw_dp, bw_edp = lay.bandwidth("dp"), ring_bandwidth(c, lay.etp * lay.ep, edp)
    opts = dict(latency=lay.dp_latency, overlapped=lay.dp_overlap, bucket=ddp_bucket_elements(replicas),
                net_overhead_us=c.net_overhead_us)
    reduce_parts = [bucketed(reduce_op, grads_dense, lay.grad_bytes, replicas, dp_nodes, bw_dp, **opts),
                    bucketed(reduce_op, grads_exp, lay.grad_bytes, edp, edp_nodes, bw_edp, **opts)]
    gather_parts = [bucketed("all_gather", grads_dense, e, replicas, dp_nodes, bw_dp, **opts),
                    bucketed("all_gather", grads_exp, e, edp, edp_nodes, bw_edp, **opts)] if zero >= 1 else []
    # ZeRO-1 (Megatron's distributed optimizer) keeps a whole gradient buffer and reduces it once, in the
    # last micro-batch's backward pass. ZeRO-2 and ZeRO-3 keep only their shard of the gradients, so every
    # micro-batch reduce-scatters what its backward pass produced (Rajbhandari et al. 2020), overlapped
    # asynchronously with the next micro-batch's compute (as Llama 3's FSDP does), the last one with its own
    # backward pass; ZeRO-3 also gathers the weights for every micro-batch's forward and backward pass.
    n_rs = mb if zero >= 2 else 1
    n_ag = 2 * mb if zero >= 3 else 1
    t_rs, t_ag = sum(p[0] for p in reduce_parts), sum(p[0] for p in gather_parts)
    # The last bucket is ready only when the backward pass ends, the first weights are needed when the
    # forward pass begins: one bucket of each stays exposed however much compute there is to hide behind.
    # (ZeRO-3 gathers again for each micro-batch: its forward waits for the first bucket, its backward's
    # gathers are taken as prefetched during the forward, so only what exceeds the backward shows.)
    last_rs, first_ag = max(p[1] for p in reduce_parts), max((p[1] for p in gather_parts), default=0.0)
    if lay.dp_overlap:
        exposed = (n_rs - 1) * max(0.0, t_rs - fwd - bwd) + max(last_rs, t_rs - bwd)
        if zero >= 3:
            exposed += mb * (max(first_ag, t_ag - fwd) + max(0.0, t_ag - bwd))
        else:
            exposed += max(first_ag, t_ag - fwd)
    else:
        exposed = n_rs * t_rs + n_ag * t_ag
    return Cost(n_rs * rs + n_ag * ag, exposed), reduce_parts[0][3]


def plan(model: Model, cluster: Cluster, tp: int = 1, sp: bool = False, cp: int = 1, ep: int = 1, pp: int = 1,
         dp: int = 1, micro_batch: int = 1, seq_len: int = 2048, recompute: str = "none", zero: int = 0,
         global_batch: int | None = None, vpp: int = 1, efficiency: float | None = None, *, etp: int = 1,
         fused: bool = True, grad_bytes: int = 4, optimizer_bytes: int = 12, fp8: bool = False,
         tp_overlap: str = "backward", dp_overlap: bool = True, cp_method: str = "ring", dedup: bool = False,
         node_limit: int | None = None, ep_overlap: bool | str = False, comm_sms: int | None = None,
         ep_imbalance: float = 1.0, schedule: str = "1f1b",
         pp_layout: str = "even", recompute_modules: tuple = (), vpp_group: int | None = None,
         attention_efficiency: float | None = None, straggler_sigma: float = 0.0, dp_latency: bool = True,
         stack: str | None = None) -> Plan:
    """Memory, traffic and time per GPU for ``model`` on ``cluster`` with this layout.

    A step processes ``global_batch`` sequences of ``seq_len`` tokens (default: 8
    micro-batches per pipeline, at least ``pp``). ``efficiency=None`` takes the cluster's
    calibrated kernel curve at each layer's matrix size; a number overrides it. ``fused``:
    a FlashAttention-style kernel (no s×s tensors kept; a causal mask skips half the scores);
    ``fused=False`` counts attention as Korthikanti et al. did. The keyword-only options are
    the software choices of the module docstring (``attention_efficiency`` runs attention's
    products at their own fraction of peak, for what-if questions; ``vpp_group`` is ``G``,
    Megatron-Core's micro-batches per virtual stage); the defaults follow Megatron-LM.

    ``ep_overlap`` hides the all-to-alls only behind work that can run while they do
    (:func:`ep_overlap_partner`): the other micro-batch of DualPipe's forward/backward chunk pair, an
    adjacent micro-batch under Megatron-Core's combined 1F1B (one stage, or virtual stages), and
    otherwise only the shared experts; ``ep_overlap="auto"`` overlaps only where one of these exists
    (as :func:`search` does). ``comm_sms`` (default: 20 when the all-to-alls are overlapped,
    DeepSeek-V3's figure, else 0) are SMs taken from computation while an overlapped all-to-all
    runs; only the steady state pairs micro-batches (:func:`paired_fraction`). ``ep_imbalance``
    (≥ 1) is the busiest expert-parallel rank's routed tokens over the mean: it scales the
    experts' time and the all-to-all's (the busiest receiver finishes last).

    ``straggler_sigma`` is the spread (standard deviation over mean) of one GPU's compute time per
    step: a synchronous step waits for the slowest of the ``gpus``, so the step's compute grows by
    ``σ · E[max of gpus standard normals]`` (:func:`expected_max_normal`). It is 0 by default: no
    published run in :data:`RECORD` reports its spread.

    The data-parallel gradients (and, with ZeRO, the weights) move in Megatron-LM's buckets
    (:func:`ddp_bucket_elements`), each costed by NCCL's model over the group's ranks and nodes
    (:func:`.collectives.nccl_time`: its latency grows with the ring, NCCL's tree where that is faster);
    overlapped, the last bucket of gradients and the first of weights stay exposed. ``dp_latency=False``
    charges their bandwidth alone, nothing exposed behind enough compute (for comparison).

    ``stack`` names the software stack the run uses (None: the one the kernel curve was fitted on). On a
    stack the curve was not fitted on, the plan's :attr:`Plan.mfu_range` and :attr:`Plan.time_range` span
    :data:`STACK_BAND` either side of the prediction (:func:`stack_band`); the prediction itself is unchanged.
    """
    lay = Layout(model, cluster, tp, sp, cp, ep, pp, dp, micro_batch, seq_len, recompute, zero, global_batch, vpp,
                 efficiency, etp, fused, grad_bytes, optimizer_bytes, fp8, tp_overlap, dp_overlap, cp_method, dedup,
                 node_limit, ep_overlap, comm_sms, ep_imbalance, schedule, pp_layout, recompute_modules, vpp_group,
                 attention_efficiency, straggler_sigma, dp_latency, stack)
    return plan_of(lay)


@dataclass(frozen=True)
class StageTime:
    """One pipeline stage's work per micro-batch, in seconds: its layers' compute (and the head's, on the
    last stage), the forward and backward parts of it, and the exposed TP, CP and EP communication."""

    compute: float
    fwd: float
    bwd: float
    tp: float
    cp: float
    ep: float

    @property
    def busy(self) -> float:
        return self.compute + self.tp + self.cp + self.ep


@dataclass(frozen=True)
class LayerCosts:
    """A layer's pieces: its compute and its exposed TP, CP and EP communication (:func:`layer_costs`)."""

    time: LayerTime
    tp: Cost
    cp: Cost
    ep: Cost


def layer_costs(lay: Layout, moe_layer: bool = False) -> LayerCosts:
    L = layer_time(lay, moe_layer)
    return LayerCosts(L, tp_cost(lay, L, moe_layer), cp_cost(lay, L), ep_cost(lay, L) if moe_layer else Cost(0.0, 0.0))


def stage_time(layers: tuple[int, int, bool], dense: LayerCosts, moe_costs: LayerCosts | None,
               head: float) -> StageTime:
    """A stage of ``(dense layers, MoE layers, holds the head)`` (:attr:`Layout.stages`): its layers'
    pieces (:func:`layer_costs`, dense and MoE) and the head's time (:func:`head_time`) added up."""
    dense_n, moe_n, has_head = layers
    compute = fwd = bwd = tp = cp = ep = 0.0
    for n, pieces in ((dense_n, dense), (moe_n, moe_costs)):
        if n:
            L = pieces.time
            compute, fwd, bwd = compute + n * L.total, fwd + n * L.fwd, bwd + n * L.bwd
            tp, cp, ep = tp + n * pieces.tp.exposed, cp + n * pieces.cp.exposed, ep + n * pieces.ep.exposed
    if has_head:
        compute, fwd, bwd = compute + head, fwd + head / 3, bwd + 2 * head / 3
    return StageTime(compute, fwd, bwd, tp, cp, ep)


def plan_of(lay: Layout) -> Plan:
    """:func:`plan` of a :class:`Layout`: its pieces added up for the slowest pipeline stage."""
    m, c, mb = lay.model, lay.cluster, lay.micro_batches
    stages = lay.stages
    dense, moe_costs = layer_costs(lay), (layer_costs(lay, True) if m.is_moe else None)
    head, eta_head = head_time(lay)
    slowest = max((stage_time(st, dense, moe_costs, head) for st in stages), key=lambda st: st.busy)
    pp_cost = pipeline_cost(lay, 0.0)[1]
    bubble, _ = pipeline_cost(lay, slowest.busy + pp_cost.exposed)
    dp, dp_algorithm = dp_cost(lay, slowest.fwd, slowest.bwd)
    compute = mb * slowest.compute
    time = StepTime(compute, bubble, mb * slowest.tp, mb * slowest.cp, mb * slowest.ep, mb * pp_cost.exposed,
                    dp.exposed, lay.straggler_sigma * expected_max_normal(lay.gpus) * compute if lay.straggler_sigma
                    else 0.0)
    fl = flops_per_token(m, lay.seq_len, lay.recompute, lay.modules)
    tokens = lay.global_batch * lay.seq_len
    flops = StepFlops(model=fl["model"] * tokens, hardware=fl["hardware"] * tokens)
    denominator = time.total * lay.gpus * c.peak
    layers_here = sum(d + x for d, x, _ in stages) / lay.pp
    comm = CommBytes(tp=mb * layers_here * dense.tp.sent, cp=mb * layers_here * dense.cp.sent,
                     ep=mb * max(sum(x for _, x, _ in stages) / lay.pp, 0) * (moe_costs.ep.sent if moe_costs else 0.0),
                     pp=mb * pp_cost.sent, dp=dp.sent)
    eta = {k: kernel_efficiency(c, layer_size(lay, k), lay.efficiency) for k in (False, True)}
    return Plan(stage_memory(lay), comm, lay.crosses_nodes, time, flops.model / denominator,
                flops.hardware / denominator, lay.gpus, flops,
                Efficiency(dense=eta[False], moe=eta[True] if m.is_moe else None, head=eta_head), mb, lay.partner,
                lay.comm_sms, dp_algorithm, lay.stack, lay.band)


# ---------------------------------------------------------------------------- search

def search(model: Model, cluster: Cluster, seq_len: int = 4096, global_batch: int = 1024, micro_batch: int = 1,
           gpus: int | None = None, efficiency: float | None = None) -> list[tuple[dict, Plan]]:
    """Every valid layout on ``gpus`` GPUs (the whole cluster by default) that fits memory,
    fastest first, all doing the same work per step (``global_batch`` sequences).

    Degrees run over divisors: tp within a node, cp up to 16, pp up to 64; expert
    parallelism folds into each stage's tp·cp·dp GPUs, ep and the expert-tensor degree etp
    (etp up to a node) both searched; the all-to-alls overlapped where the schedule gives them
    something to overlap with (:func:`ep_overlap_partner`, said in each plan's
    ``ep_hidden_behind``), with the SMs that takes (``EP_COMM_SMS``), and exposed where it gives
    nothing; sequence parallelism
    whenever tp > 1; ZeRO-1 (the distributed optimizer) always; recomputation none or full
    (with the fused attention the planner assumes, selective recomputation keeps the same
    tensors); 2 virtual stages per GPU where the layers allow.
    """
    n = cluster.gpus if gpus is None else _whole(gpus, "gpus")
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    c = dataclasses.replace(cluster, gpus=n)
    found = []
    for tp in [d for d in divisors if d <= cluster.gpus_per_node]:
        for cp in [d for d in divisors if d <= 16]:
            for pp in [d for d in divisors if d <= min(64, model.layers)]:
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                folds = [(e, t) for e in divisors for t in divisors
                         if t <= cluster.gpus_per_node and (tp * cp * dp) % (e * t) == 0] if model.is_moe else [(1, 1)]
                for ep, etp in folds:
                    for recompute in ("none", "full"):
                        kw = dict(tp=tp, sp=tp > 1, cp=cp, ep=ep, etp=etp, pp=pp, dp=dp, micro_batch=micro_batch,
                                  seq_len=seq_len, recompute=recompute, zero=1, global_batch=global_batch,
                                  vpp=2 if pp > 1 and model.layers % (2 * pp) == 0 else 1)
                        try:
                            pl = plan(model, c, efficiency=efficiency, ep_overlap="auto", **kw)
                        except ValueError:
                            continue
                        if pl.fits:
                            found.append((kw, pl))
    found.sort(key=lambda item: item[1].time.total)
    return found


# ---------------------------------------------------------------------------- the published record

@dataclass(frozen=True)
class Run:
    """One published training run: what it was, what was measured, and how the planner uses it.

    ``layout`` holds :func:`plan`'s arguments. ``metric`` is ``"MFU"`` or ``"HFU"`` (the paper's
    own count: Narayanan et al. report FLOP/s that count full recomputation). ``role`` is ``"fit"``
    (the kernel curve passes through it) or ``"test"`` (held out). ``assumed`` names what the
    source does not state and the planner takes. ``stack`` is the software it ran on.
    """

    name: str
    source: str
    model: Model
    cluster: Cluster
    layout: dict
    published: float
    metric: str
    role: str
    assumed: str = ""
    stack: str = MEGATRON

    def plan(self, efficiency=None) -> Plan:
        return plan(self.model, self.cluster, efficiency=efficiency, stack=self.stack, **self.layout)

    def predicted(self, efficiency=None) -> float:
        pl = self.plan(efficiency)
        return pl.mfu if self.metric == "MFU" else pl.hfu

    def predicted_range(self, efficiency=None) -> tuple[float, float]:
        """(low, high) of the run's metric: one number twice on a stack the curve was fitted on, else
        :data:`STACK_BAND` either side of it (:func:`stack_band`)."""
        pl = self.plan(efficiency)
        return pl.mfu_range if self.metric == "MFU" else pl.hfu_range

    def on_fitted_stack(self) -> bool:
        """Whether the kernel curve of the run's GPUs was fitted on runs of the run's stack."""
        return stack_band(self.cluster, self.stack) == 1.0

    def residual(self, efficiency=None) -> float:
        """Predicted over published, minus one."""
        return self.predicted(efficiency) / self.published - 1


def _gpt(name: str, heads: int, hidden: int, layers: int, vocab: int = 51200) -> Model:
    """A GPT model of the Megatron-LM papers: multi-head attention, an MLP of 4h, dropout."""
    return Model(name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab)


def _cluster(name: str, gpus: int) -> Cluster:
    return dataclasses.replace(CLUSTERS[name], gpus=gpus)


def _korthikanti() -> list[Run]:
    """Korthikanti et al. 2022, Tables 3 and 5: t = 8, s = 2048, v = 51200, A100 80 GB, no data
    parallelism; interleaving with 3 stages for 175B and 530B (§6). "Present work" is sequence
    parallelism with selective recomputation; "full recompute" is without sequence parallelism, its
    MFU the present work's scaled by the two iteration times of Table 5."""
    runs = []
    common = dict(tp=8, dp=1, seq_len=2048, fused=False, tp_overlap="backward", dp_overlap=False)
    table = (("22B", 64, 6144, 48, 1, 1, 4, 4, 0.415, 1.42, 1.10), ("175B", 96, 12288, 96, 8, 3, 64, 1, 0.514, 18.13, 13.75),
             ("530B", 128, 20480, 105, 35, 3, 280, 1, 0.560, 49.05, 37.83),
             ("1T", 160, 25600, 128, 64, 1, 512, 1, 0.563, 94.42, 71.49))
    for name, a, h, L, pp, vpp, batch, micro, mfu, t_full, t_ours in table:
        m = MODELS["GPT-3 175B"] if name == "175B" else _gpt(f"GPT {name}", a, h, L)
        c = _cluster(_A100, 8 * pp)
        kw = dict(common, pp=pp, vpp=vpp, micro_batch=micro, global_batch=batch)
        role = "fit" if name in ("22B", "1T") else "test"
        runs.append(Run(f"Korthikanti {name}", "korthikanti2022reducing (Tables 3, 5)", m, c,
                        dict(kw, sp=True, recompute="selective"), mfu, "MFU", role,
                        "bf16 (fp32 gradient reduction); 1T not interleaved (the paper names 175B and 530B)"))
        runs.append(Run(f"Korthikanti {name} full recompute", "korthikanti2022reducing (Table 5)", m, c,
                        dict(kw, sp=False, recompute="full"), round(mfu * t_ours / t_full, 4), "MFU", "test",
                        "MFU from the iteration times of Table 5"))
    m = _gpt("GPT 530B", 128, 20480, 105)
    runs.append(Run("Korthikanti 530B, dp = 8", "korthikanti2022reducing (§6.3)", m, _cluster(_A100, 2240),
                    dict(common, pp=35, vpp=3, dp=8, micro_batch=1, global_batch=2240, sp=True,
                         recompute="selective"), 0.542, "MFU", "test",
                    "batch per replica as in Table 3; gradient all-reduce not overlapped (§6.3)"))
    return runs


def _narayanan() -> list[Run]:
    """Narayanan et al. 2021, Table 1, the rows without pipeline parallelism: A100 80 GB, s = 2048,
    V = 51200, full recomputation; "% of peak" counts the recomputed forward (their eq. 3)."""
    runs = []
    for name, a, h, L, t, gpus, batch, tflops in (("1.7B", 24, 2304, 24, 1, 32, 512, 137),
                                                   ("3.6B", 32, 3072, 30, 2, 64, 512, 138),
                                                   ("7.5B", 32, 4096, 36, 4, 128, 512, 142),
                                                   ("18.4B", 48, 6144, 40, 8, 256, 1024, 135)):
        runs.append(Run(f"Narayanan {name}", "narayanan2021efficient (Table 1)", _gpt(f"GPT {name}", a, h, L),
                        _cluster(_A100, gpus), dict(tp=t, dp=gpus // t, global_batch=batch, seq_len=2048,
                                                    recompute="full", fused=False, tp_overlap="none",
                                                    dp_overlap=False, grad_bytes=2),
                        tflops * 1e12 / CLUSTERS[_A100].peak, "HFU", "test",
                        "fp16 gradients all-reduced in fp16 and nothing overlapped (Megatron-LM's defaults in 2021); "
                        "micro-batch 1"))
    return runs


def _megatron_core() -> list[Run]:
    """Megatron-LM README (commit f2e5db40, July 2024; H100): GPT models, s = 4096, V = 131072,
    TP, DP (and PP) communication overlapped (--tp-comm-overlap, --overlap-grad-reduce,
    --overlap-param-gather), MFU from the per-GPU TFLOP/s against 989 TFLOP/s."""
    runs = []
    table = (("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
             ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
             ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
             ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
             ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9))
    for name, a, h, L, t, pp, gpus, batch, tflops in table:
        runs.append(Run(f"Megatron-Core {name}", "megatronreadme2024", _gpt(f"GPT {name}", a, h, L, 131072),
                        _cluster(_H100, gpus), dict(tp=t, sp=t > 1, pp=pp, dp=48, global_batch=batch, seq_len=4096,
                                                    zero=1, tp_overlap="all", dp_overlap=True),
                        tflops * 1e12 / H100_BF16_PEAK, "MFU", "fit" if name == "7.1B" else "bracket",
                        "micro-batch 1, no interleaving, no recomputation, sequence parallelism with t > 1 "
                        "(the README gives none of them)"))
    return runs


def deepseek_v3_mfu(gpu_hours_per_trillion: float = 180e3, seq_len: int = 4096) -> float:
    """DeepSeek-V3's MFU as its report lets one compute it: 180K H800 GPU-hours per trillion
    tokens (§1, pre-training), model FLOPs per token as :func:`flops_per_token` counts them
    (without the multi-token-prediction module), over the dense bf16 peak."""
    tokens_per_gpu_second = 1e12 / (gpu_hours_per_trillion * 3600)
    return flops_per_token(MODELS["DeepSeek-V3"], seq_len)["model"] * tokens_per_gpu_second / CLUSTERS[_H800].peak


def _llama_and_deepseek() -> list[Run]:
    llama = MODELS["Llama 3 405B"]
    common = dict(tp=8, sp=True, pp=16, vpp=8, pp_layout="ends", zero=2, dp_overlap=True, cp_method="allgather")
    note = ("8 virtual stages of one layer (126 layers, embedding and head in place of a layer: §3.3.2), micro-batch "
            "1, sequence parallelism; fp32 gradients sharded with the optimizer states (ZeRO-2: §3.3.2's FSDP "
            "shards optimizer states and gradients, not the weights between forward and backward)")
    runs = []
    for gpus, cp, dp, seq, tflops, role in ((8192, 1, 64, 8192, 430, "fit"), (16384, 1, 128, 8192, 400, "test"),
                                             (16384, 16, 8, 131072, 380, "test")):
        runs.append(Run(f"Llama 3 405B, {gpus:,} GPUs, {seq // 1024}K", "llama3 (Table 4)", llama,
                        _cluster(_H100, gpus), dict(common, cp=cp, dp=dp, seq_len=seq, global_batch=2 ** 24 // seq),
                        tflops * 1e12 / H100_BF16_PEAK, "MFU", role, note, LLAMA3_STACK))
    runs.append(Run("DeepSeek-V3, 2,048 H800", "deepseekv3 (§1, §3)", MODELS["DeepSeek-V3"], CLUSTERS[_H800],
                    dict(tp=1, pp=16, ep=64, dp=128, seq_len=4096, global_batch=15360, schedule="dualpipe", fp8=True,
                         dedup=True, node_limit=4, ep_overlap=True, comm_sms=20, zero=1, optimizer_bytes=8,
                         recompute_modules=("layernorm", "mla_up_proj", "moe_act"), pp_layout="ends"),
                    deepseek_v3_mfu(), "MFU", "test",
                    "MFU derived from GPU-hours; micro-batch 1; stages balanced with the embedding and head in a "
                    "layer's place; the MTP module not modelled", HAI_LLM))
    return runs


#: Published runs with their layouts complete enough to predict (Korthikanti et al., Narayanan et
#: al., Megatron-Core 7.1B, Llama 3, DeepSeek-V3), and the Megatron-Core README's runs whose
#: micro-batch and interleaving are unpublished (``role="bracket"``: see :func:`bracket`).
RECORD = tuple(_korthikanti() + _narayanan() + _megatron_core() + _llama_and_deepseek())


def independent_of_fit(run: Run, record=RECORD) -> bool:
    """A held-out run from another source (paper or benchmark) than every run its GPU generation's
    curve was fitted on. Held out is not independent: a row of the fit's own table shares its
    benchmark, its software and often its layout."""
    paper = run.source.split()[0]
    fitted = {r.source.split()[0] for r in record if r.role == "fit" and r.cluster.generation == run.cluster.generation}
    return run.role == "test" and paper not in fitted


def calibrate(generation: str, record=RECORD) -> KernelCurve:
    """The kernel curve through the two ``fit`` runs of ``generation``: both predicted exactly.

    For each ``n_half`` the run at the larger size fixes ``eta_max`` (MFU rises with it);
    bisection on ``n_half`` then makes the other run agree too. Deterministic; ~2,000 plans.
    """
    runs = [r for r in record if r.role == "fit" and r.cluster.generation == generation]
    if len(runs) != 2:
        raise ValueError(f"calibrate needs exactly two fit runs for {generation}, found {len(runs)}")
    big, small = sorted(runs, key=lambda r: -gemm_size(r.model, r.layout.get("tp", 1)))

    def eta_for(n_half: float) -> float:
        lo, hi = 0.05, 3.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if big.residual(KernelCurve(mid, n_half)) > 0:
                hi = mid
            else:
                lo = mid
        return (lo + hi) / 2

    def miss(n_half: float) -> float:
        return small.residual(KernelCurve(eta_for(n_half), n_half))

    lo, hi = 0.0, 50000.0
    if miss(lo) <= 0:                                   # even a flat curve predicts the small run too low
        n_half = lo
    else:
        for _ in range(40):
            mid = (lo + hi) / 2
            if miss(mid) > 0:
                lo = mid
            else:
                hi = mid
        n_half = (lo + hi) / 2
    stacks = tuple(dict.fromkeys((big.stack, small.stack)))
    return KernelCurve(round(eta_for(n_half), 4), round(n_half, 1), (big.name, small.name), stacks)


def bracket(run: Run) -> tuple[tuple[float, dict], tuple[float, dict]]:
    """The lowest and highest prediction over what a run's source leaves open: the micro-batch
    (a divisor of the sequences per replica), the virtual stages (a divisor of the layers per
    stage) and selective or no recomputation, among the layouts that fit memory."""
    per_replica = run.layout["global_batch"] // run.layout["dp"]
    pp = run.layout.get("pp", 1)
    per_stage = run.model.layers // pp
    found = []
    for micro in [d for d in range(1, per_replica + 1) if per_replica % d == 0]:
        for vpp in ([v for v in range(1, per_stage + 1) if per_stage % v == 0] if pp > 1 else [1]):
            for recompute in ("none", "selective"):
                kw = dict(run.layout, micro_batch=micro, vpp=vpp, recompute=recompute)
                try:
                    pl = plan(run.model, run.cluster, **kw)
                except ValueError:
                    continue
                if pl.fits:
                    found.append((pl.mfu if run.metric == "MFU" else pl.hfu,
                                  dict(micro_batch=micro, vpp=vpp, recompute=recompute)))
    if not found:
        raise ValueError(f"no layout of {run.name} fits memory")
    return min(found, key=lambda f: f[0]), max(found, key=lambda f: f[0])
