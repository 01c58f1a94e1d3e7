"""intralayer.planner (chapter 08): presets, the rules, every formula against a hand-computed
case, and the planner against the published record."""
from __future__ import annotations

import dataclasses
import math

import pytest

from intralayer import context_parallel as cp, memory, model, moe, rules
from intralayer import collectives as C
from intralayer import planner as P

H100 = P.CLUSTERS["1024× H100 (128 nodes of 8, InfiniBand)"]
A100 = P.CLUSTERS["A100 cluster (nodes of 8, InfiniBand HDR)"]
GPT3 = P.MODELS["GPT-3 175B"]


# ---------------------------------------------------------------------------- presets

def test_presets_count_the_published_sizes():
    assert round(P.params(P.MODELS["Mixtral 8x7B"])["total"] / 1e9, 1) == 46.7
    assert round(P.params(P.MODELS["DeepSeek-V3"])["total"] / 1e9) == 671
    assert 174e9 < P.params(GPT3)["total"] < 176e9
    assert 69e9 < P.params(P.MODELS["Llama 3 70B"])["total"] < 72e9
    assert 400e9 < P.params(P.MODELS["Llama 3 405B"])["total"] < 410e9
    for c in P.CLUSTERS.values():
        assert c.gpus % c.gpus_per_node == 0 and c.memory > 0 and c.peak > 0
    assert any("A100" in k for k in P.CLUSTERS) and any("H100" in k for k in P.CLUSTERS)


def test_moe_presets_come_from_the_moe_module():
    """One source: every number of the planner's MoE models is read from intralayer.moe's preset."""
    for name, config in (("Mixtral 8x7B", moe.MIXTRAL_8X7B), ("DeepSeek-V3", moe.DEEPSEEK_V3)):
        m = P.MODELS[name]
        assert m.moe_config is config and m == P.Model.from_moe(config)
        assert (m.layers, m.hidden, m.heads, m.experts, m.top_k, m.moe_ffn, m.vocab) == \
            (config.layers, config.hidden, config.heads, config.experts, config.top_k, config.moe_ffn, config.vocab)
        assert m.dense_layers == config.dense_layers and m.shared_experts == config.shared_experts
        assert not m.dropout
    assert P.MODELS["DeepSeek-V3"].head_dims == (192, 128)           # MLA: 128 + 64 for q·k, 128 for v


def test_models_and_clusters_are_frozen_and_replaceable():
    c = dataclasses.replace(H100, gpus=64)
    assert c.gpus == 64 and c.peak == H100.peak
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.gpus = 8
    m = P.Model(name="tiny", layers=2, hidden=64, heads=8, kv_heads=8, ffn=256, vocab=128)
    assert dataclasses.replace(m, layers=4).layers == 4


# ---------------------------------------------------------------------------- the rules

@pytest.mark.parametrize("kw, rule", [
    (dict(tp=3), "does not divide the cluster"),
    (dict(tp=64), "attention heads are not divisible by tp=64"),
    (dict(pp=128), "more than the model's 96 layers"),
    (dict(pp=8, vpp=16), "pp·vpp = 8·16 = 128"),
    (dict(vpp=2), "vpp=2 virtual stages need pipeline parallelism"),
    (dict(cp=2, seq_len=2050), "not divisible by 2·cp"),
    (dict(sp=True), "sequence parallelism needs tp > 1"),
    (dict(ep=2, dp=2), "needs a mixture-of-experts model"),
    (dict(recompute="some"), "recompute must be one of"),
    (dict(zero=4), "zero must be 0, 1, 2 or 3"),
    (dict(tp=0), "tp must be a whole number"),
    (dict(efficiency=1.5), "efficiency must lie in"),
    (dict(attention_efficiency=0), "attention_efficiency must lie in"),
    (dict(schedule="gpipe"), "schedule must be one of"),
    (dict(tp_overlap="some"), "tp_overlap must be one of"),
    (dict(cp_method="ulysses"), "cp_method must be one of"),
    (dict(pp_layout="odd"), "pp_layout must be one of"),
    (dict(fp8=True), "has no FP8 peak"),
    (dict(pp=4, vpp=2, schedule="dualpipe", global_batch=1024), "DualPipe needs an even number of stages"),
    (dict(pp=4, schedule="dualpipe", global_batch=6), "at least 2·pp = 8"),
    (dict(pp=4, schedule="dualpipe", global_batch=9), "an even number"),
    (dict(grad_bytes=3), "grad_bytes must be 2"),
    (dict(recompute_modules=("mla_up_proj",)), "needs multi-head latent attention"),
    (dict(recompute_modules=("attn",)), "recompute_modules must be among"),
    (dict(pp=2, vpp=2, vpp_group=0, global_batch=16), "vpp_group must be a whole number"),
    (dict(vpp_group=2), "it needs vpp > 1"),
    (dict(comm_sms=108), "leaves none of the GPU's 108 SMs"),
    (dict(pp=8, dp=2, global_batch=8), "cannot fill pp=8"),
])
def test_invalid_layouts_name_the_rule(kw, rule):
    with pytest.raises(ValueError, match=rule):
        P.plan(GPT3, dataclasses.replace(A100, gpus=1024), **kw)


def test_the_gpu_and_sequence_rules_come_from_rules_and_the_layout_registry():
    """One source: the planner's GPU rule is rules.check_mesh's, its sequence rule the chunk
    count of the context-parallel layout it assumes (Megatron-LM's zigzag, 2·cp chunks)."""
    with pytest.raises(ValueError) as planner_error:
        P.check_layout(GPT3, H100, tp=8, pp=8, dp=3)
    with pytest.raises(ValueError) as mesh_error:
        rules.check_mesh(1024, world="the cluster's GPU count", unit="GPUs", tp=8, cp=1, pp=8, dp=3)
    assert str(planner_error.value) == str(mesh_error.value)
    assert "tp·cp·pp·dp = 8·1·8·3 = 192 GPUs" in str(planner_error.value)
    assert P.CP_LAYOUT == "zigzag" and cp.n_chunks(4, P.CP_LAYOUT) == 8
    P.check_layout(GPT3, H100, cp=4, seq_len=2056)                            # 8 chunks of 257
    with pytest.raises(ValueError, match=r"seq_len 2052 is not divisible by 2·cp = 8 \(zigzag context parallelism\)"):
        P.check_layout(GPT3, H100, cp=4, seq_len=2052)
    P.check_layout(GPT3, H100, cp=1, seq_len=2047)                            # no context parallelism: any length
    assert P.RECOMPUTE is memory.RECOMPUTE is model.RECOMPUTE                # recomputation choices, defined once


def test_expert_parallelism_folds_into_each_stage():
    """Megatron-Core's folding: ep may span the tensor-parallel ranks; etp·ep must divide tp·cp·dp."""
    ds = P.MODELS["DeepSeek-V3"]
    h800 = P.CLUSTERS["2048× H800 (DeepSeek-V3's cluster)"]
    P.check_layout(ds, h800, tp=1, ep=64, pp=16, dp=128)                        # DeepSeek-V3's own layout
    P.check_layout(ds, h800, tp=8, sp=True, ep=64, pp=16, dp=16)                 # TP for attention, EP for experts
    with pytest.raises(ValueError, match="tp·cp·dp = 128 GPUs: etp·ep = 1·256 = 256 must divide it"):
        P.check_layout(ds, h800, tp=8, sp=True, ep=256, pp=16, dp=16)
    with pytest.raises(ValueError, match="8 experts do not split evenly over ep=16"):
        P.check_layout(P.MODELS["Mixtral 8x7B"], H100, ep=16, dp=16)
    # folding conserves the work: the experts' FLOPs per GPU do not depend on how ep is laid out
    mix = P.MODELS["Mixtral 8x7B"]
    c = dataclasses.replace(H100, gpus=64)
    a = P.plan(mix, c, tp=8, sp=True, ep=8, dp=8, seq_len=4096, global_batch=64, efficiency=0.5)
    b = P.plan(mix, c, tp=8, sp=True, ep=2, dp=8, seq_len=4096, global_batch=64, efficiency=0.5)
    assert a.time.compute == pytest.approx(b.time.compute)
    assert a.memory_bytes.weights < b.memory_bytes.weights                 # more ways to split the experts


# ---------------------------------------------------------------------------- FLOPs

def test_model_and_hardware_flops_are_narayanans():
    """GPT-3: 72·l·h²·(1 + s/(6h) + V/(12·l·h)) per token; full recomputation 96·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    l, h, V, s = 96, 12288, 51200, 2048
    f = P.flops_per_token(GPT3, s)
    assert f["model"] == pytest.approx(72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12)
    assert f["model"] == pytest.approx(P.narayanan_flops(1, s, l, h, V) / s, rel=1e-12)
    full = P.flops_per_token(GPT3, s, "full")["hardware"]
    assert full == pytest.approx(96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)), rel=1e-12)
    assert full == pytest.approx(P.narayanan_flops(1, s, l, h, V, recompute=True) / s, rel=1e-12)
    sel = P.flops_per_token(GPT3, s, "selective")["hardware"]
    assert sel - f["model"] == pytest.approx(l * 4 * s * h)      # scores and weighted sum, forward: 4·s·h per layer


def test_gqa_swiglu_and_moe_flops_count_the_active_parameters():
    # Llama 3 405B: q, o are h×h, k, v are h×(8·128); SwiGLU has three h×ffn matrices
    m, s = P.MODELS["Llama 3 405B"], 8192
    h, L, V, ffn = 16384, 126, 128256, 53248
    per_layer = 2 * h * h + 2 * h * 8 * 128 + 3 * h * ffn
    want = 6 * L * per_layer + 6 * h * V + 6 * L * s * 128 * (128 + 128)
    assert P.flops_per_token(m, s)["model"] == pytest.approx(want, rel=1e-12)
    # MoE: 6 per active parameter (the k routed experts, shared experts, router; not the embedding
    # lookup or the norms), plus attention's products
    for name in ("Mixtral 8x7B", "DeepSeek-V3"):
        m = P.MODELS[name]
        f = P.flops_per_token(m, 4096)
        parts = moe.param_breakdown(m.moe_config)
        matmul_active = sum(a for k, (_, a) in parts.items() if k not in ("embedding", "norms"))
        if m.moe_config.router_bias:                                   # DeepSeek-V3's selection bias: no product
            matmul_active -= m.moe_layers * m.experts
        assert f["model"] - f["attention"] == pytest.approx(6 * matmul_active, rel=1e-12), name
    # Mixtral by hand: 2 of 8 experts of 3·4096·14336, router 4096·8, GQA 8 of 32 heads
    mix = P.MODELS["Mixtral 8x7B"]
    h, L = 4096, 32
    layer = 2 * h * h + 2 * h * 1024 + 2 * 3 * h * 14336 + h * 8
    assert P.flops_per_token(mix, 4096)["model"] == pytest.approx(6 * L * layer + 6 * h * 32000
                                                                   + 6 * L * 4096 * 32 * 256, rel=1e-12)


def test_mfu_and_hfu_divide_the_same_step_time():
    c = dataclasses.replace(A100, gpus=64)
    pl = P.plan(GPT3, c, tp=8, sp=False, pp=8, seq_len=2048, recompute="full", global_batch=64, fused=False)
    ratio = P.flops_per_token(GPT3, 2048, "full")["hardware"] / P.flops_per_token(GPT3, 2048)["model"]
    assert pl.hfu / pl.mfu == pytest.approx(ratio)
    assert pl.mfu == pytest.approx(pl.flops.model / (pl.time.total * 64 * c.peak))


# ---------------------------------------------------------------------------- memory

def test_model_states_are_megatrons_18_bytes_and_6_plus_12_over_d():
    d = 64
    assert sum(P.model_state_bytes(1, d, zero=0).values()) == 18
    assert sum(P.model_state_bytes(1, d, zero=1).values()) == pytest.approx(6 + 12 / d)
    assert sum(P.model_state_bytes(1, d, zero=0, grad_bytes=2).values()) == 16
    assert sum(P.model_state_bytes(1, d, zero=2).values()) == pytest.approx(2 + 16 / d)
    assert sum(P.model_state_bytes(1, d, zero=3).values()) == pytest.approx(18 / d)
    assert sum(P.model_state_bytes(1, d, zero=1, optimizer_bytes=8).values()) == pytest.approx(6 + 8 / d)


def test_memory_counts_the_most_loaded_stage_as_megatron_does():
    """GPT-3, t = 8, pp = 8: the first stage holds 12 layers and one embedding table (bytes ×
    18, or 6 + 12/d with the distributed optimizer); activations are L layers' worth."""
    c = dataclasses.replace(H100, gpus=1024)
    kw = dict(tp=8, sp=True, pp=8, dp=16, seq_len=2048, global_batch=1536)
    lp = P.layer_params(GPT3)
    stage = 12 * (lp["attention"] + lp["mlp"]) / 8 + 12 * lp["norms"] + 51200 * 12288 / 8
    base = P.plan(GPT3, c, zero=0, **kw)
    assert base.memory_bytes.weights + base.memory_bytes.gradients + base.memory_bytes.optimizer == \
        pytest.approx(18 * stage)
    z1 = P.plan(GPT3, c, zero=1, **kw)
    assert z1.memory_bytes.optimizer == pytest.approx(12 * stage / 16)
    per_layer = sum(memory.activation_terms(2048, 1, 12288, 96, t=8, sp=True, fused=True).values())
    assert base.memory_bytes.activations == pytest.approx(96 * per_layer)
    # pp = 1: both tables, and the logits (fp32) with their input
    one = P.plan(GPT3, dataclasses.replace(c, gpus=8), tp=8, sp=True, seq_len=2048, global_batch=1, recompute="full")
    lp_all = 96 * ((lp["attention"] + lp["mlp"]) / 8 + lp["norms"]) + 2 * 51200 * 12288 / 8
    assert one.memory_bytes.weights == pytest.approx(2 * lp_all)
    assert one.memory_bytes.activations == pytest.approx(96 * 2048 * 12288 * 2 / 8 + 4 * 2048 * (12288 + 51200) / 8)


def test_interleaving_holds_megatrons_warm_up_on_the_first_stage():
    """vpp chunks: 2(p−1) + (v−1)·N + 1 chunks in flight (N = p by default), i.e. L·(1 + (p−1)/(p·v))."""
    c = dataclasses.replace(H100, gpus=64)
    kw = dict(tp=8, sp=True, pp=8, seq_len=2048, global_batch=64)
    plain = P.plan(GPT3, c, **kw).memory_bytes.activations
    inter = P.plan(GPT3, c, vpp=3, **kw).memory_bytes.activations
    assert inter / plain == pytest.approx(1 + 7 / (8 * 3))
    grouped = P.plan(GPT3, c, vpp=3, vpp_group=4, **kw).memory_bytes.activations
    assert grouped / plain == pytest.approx((2 * 7 + 2 * 4 + 1) / 3 / 8)


def test_activations_follow_the_model():
    """No dropout masks without dropout; SwiGLU keeps three ffn-wide tensors; an MoE layer keeps
    k routed copies and their outputs; FP8 keeps the linear layers' inputs in one byte."""
    s, b, t = 4096, 1, 8
    gpt = P.Model("gpt", layers=1, hidden=4096, heads=32, kv_heads=32, ffn=16384, vocab=128)
    terms = P.layer_activation_terms(gpt, s, b, t, True, "none", False, fused=True)
    no_drop = P.layer_activation_terms(dataclasses.replace(gpt, dropout=False), s, b, t, True, "none", False, True)
    masks = sum(v for k, v in memory.activation_terms(s, b, 4096, 32, t=t, sp=True, fused=True).items() if "mask" in k)
    assert sum(terms.values()) - sum(no_drop.values()) == pytest.approx(masks)
    swiglu = P.layer_activation_terms(dataclasses.replace(gpt, mlp_matrices=3), s, b, t, True, "none", False, True)
    assert swiglu["MLP wide tensors"] == pytest.approx(3 * s * b * 16384 * 2 / t)
    mix = P.MODELS["Mixtral 8x7B"]
    moe_terms = P.layer_activation_terms(mix, s, b, t, True, "none", True, True)
    assert moe_terms["routed copies"] == pytest.approx(s / t * 2 * 4096 * 2)
    assert moe_terms["expert outputs"] == pytest.approx(s / t * 2 * 4096 * 2)
    assert moe_terms["expert wide tensors"] == pytest.approx(s / t * 2 * 14336 * 3 * 2)
    fp8 = P.layer_activation_terms(mix, s, b, t, True, "none", True, True, fp8=True)
    assert fp8["routed copies"] == moe_terms["routed copies"] / 2
    ds = P.MODELS["DeepSeek-V3"]
    full = P.layer_activation_terms(ds, s, b, 1, False, "none", True, True, True)
    lean = P.layer_activation_terms(ds, s, b, 1, False, "none", True, True, True, ("layernorm", "mla_up_proj"))
    assert lean["Q and K"] == lean["V"] == lean["fc1 input"] == 0 < full["Q and K"]
    assert full["Q and K"] == pytest.approx(s * 128 * 192 * 2 * 2) and lean["latents"] == full["latents"]


# ---------------------------------------------------------------------------- time

def _tiny(**kw):
    m = P.Model("tiny", layers=16, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=1024)
    return P.plan(m, dataclasses.replace(H100, gpus=kw.pop("gpus", 16)), efficiency=kw.pop("efficiency", 0.5),
                  seq_len=1024, **kw)


def test_interleaved_bubble_is_p_minus_1_over_v_m():
    for vpp, mb in ((1, 8), (2, 8), (4, 16)):
        pl = _tiny(pp=4, dp=4, vpp=vpp, global_batch=4 * mb, dp_overlap=False)
        t = pl.time
        per_mb = (t.total - t.bubble - t.dp_comm) / mb
        assert t.bubble == pytest.approx((4 - 1) / vpp * per_mb)
        assert t.bubble / (t.total - t.bubble - t.dp_comm) == pytest.approx(3 / (vpp * mb))


def test_dualpipe_bubble_is_deepseeks_table_2():
    """(pp/2 − 1)(F&B + B − 3W) with F&B = F + B, B = 2F, W = F: (pp/2 − 1)·2F = (pp/2 − 1)·(2/3)·(F + B)."""
    pl = _tiny(pp=4, dp=4, schedule="dualpipe", global_batch=32, dp_overlap=False)
    per_mb = (pl.time.total - pl.time.bubble - pl.time.dp_comm) / 8
    assert pl.time.bubble == pytest.approx((4 / 2 - 1) * 2 / 3 * per_mb)


def test_uneven_stages_put_the_head_on_the_last():
    m = P.MODELS["Llama 3 405B"]
    even = P._stage_layers(m, 16, "even")
    ends = P._stage_layers(m, 16, "ends")
    assert [d for d, _, _ in even] == [8] * 14 + [7] * 2 and even[-1][2] and not even[0][2]
    assert [d for d, _, _ in ends] == [7] + [8] * 14 + [7]                   # 128 slots, embedding and head in two
    ds = P._stage_layers(P.MODELS["DeepSeek-V3"], 16, "even")
    assert ds[0] == (3, 1, False) and sum(d + x for d, x, _ in ds) == 61


def test_tensor_parallel_overlap_rules():
    """With sequence parallelism each all-reduce is a reduce-scatter and an all-gather, and the backward
    re-gathers the two column layers' inputs (half an all-reduce's bytes each). none: everything exposed;
    backward: the backward pair hides behind the weight gradients and the re-gathers behind the input
    gradients (each half the backward); all: each reduce-scatter and all-gather behind the one product
    beside it (q·k·v, output, fc1, fc2), Transformer Engine's way, not behind the whole layer."""
    kw = dict(tp=8, sp=True, dp=2, global_batch=2, dp_overlap=False)
    none, back, every = (_tiny(tp_overlap=o, **kw) for o in ("none", "backward", "all"))
    per_pair = 2 * P.bus_factor("all_reduce", 8) * 1024 * 1024 * 2 / H100.intra       # 2 all-reduces of s·b·h
    regather = per_pair / 2                                                          # 2 all-gathers of s·b·h
    h, s = 1024, 1024                                                                # one layer's forward:
    fwd = (2 * s * 12 * h * h / 8 + 2 * s * s * 8 * 256 / 8 / 2) / (H100.peak * 0.5)    # products, causal half
    assert none.time.tp_comm == pytest.approx(16 * (2 * per_pair + regather))
    assert back.time.tp_comm == pytest.approx(16 * (per_pair + max(0, per_pair - fwd) + max(0, regather - fwd)))
    half = per_pair / 4                                       # one reduce-scatter or all-gather of s·b·h
    products = [p / 8 * 2 * s / (H100.peak * 0.5) for p in (3 * h * h, h * h, 4 * h * h, 4 * h * h)]
    forward = sum(max(0, half - t) for t in products)
    backward = sum((2, 1, 2, 1)[k] * max(0, half - t) for k, t in enumerate(products))   # column, row, column, row
    assert every.time.tp_comm == pytest.approx(16 * (forward + backward))
    assert every.time.tp_comm > 0                          # the output projection is too small to hide it
    whole_layer = 16 * (max(0, per_pair - fwd) + max(0, per_pair - 2 * fwd))          # the old, generous rule
    assert every.time.tp_comm > whole_layer
    assert none.time.tp_comm > back.time.tp_comm > every.time.tp_comm
    assert none.comm_bytes.tp == pytest.approx(16 * 1.25 * 2 * per_pair * H100.intra)   # SP: 1.25× TP's bytes
    plain = _tiny(tp_overlap="none", **dict(kw, sp=False))
    assert plain.comm_bytes.tp == pytest.approx(16 * 2 * per_pair * H100.intra)
    full = _tiny(tp_overlap="none", recompute="full", **kw)
    assert full.time.tp_comm == pytest.approx(16 * (3 * per_pair + regather))   # the recomputed forward again
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        _tiny(tp_overlap="all", **dict(kw, sp=False))


_TINY_PARAMS = 16 * (4 * 1024 ** 2 + 2 * 1024 * 4096 + 2 * 1024) + 2 * 1024 * 1024


def _tiny_dp_times(overlapped=True):
    """The tiny model's gradients (fp32) and weights (bf16) over 16 data-parallel ranks on 2 nodes of 8,
    in Megatron's buckets of 4·10⁷ elements (one bucket when not overlapped, as Megatron-LM does without
    --overlap-grad-reduce), each a ring with NCCL's latency: 8.4 µs, then 15 steps of which one crosses
    the network (14 µs) and 14 stay inside a node (3.4 µs)."""
    bw = P.ring_bandwidth(H100, 1, 16)
    buckets = math.ceil(_TINY_PARAMS / 40e6) if overlapped else 1
    latency = 1e-6 * (8.4 + 14 * 3.4 + 14.0)
    t_rs = P.bus_factor("reduce_scatter", 16) * _TINY_PARAMS * 4 / bw + buckets * latency
    t_ag = P.bus_factor("all_gather", 16) * _TINY_PARAMS * 2 / bw + buckets * latency
    return t_rs, t_ag, buckets, bw


def test_data_parallel_overlap_is_the_last_micro_batch_only():
    """Overlapped, the reduction hides behind the last backward pass and the gather behind the first
    forward, except one bucket of each: the last gradients are ready when the backward ends."""
    kw = dict(dp=16, global_batch=64, zero=1)
    off, on = _tiny(dp_overlap=False, **kw), _tiny(dp_overlap=True, **kw)
    t_rs, t_ag, buckets, _ = _tiny_dp_times()
    assert buckets == 6
    assert off.time.dp_comm == pytest.approx(sum(_tiny_dp_times(overlapped=False)[:2]))
    per_mb = off.time.compute / 4
    assert on.time.dp_comm == pytest.approx(max(t_rs / buckets, t_rs - per_mb * 2 / 3)
                                               + max(t_ag / buckets, t_ag - per_mb / 3), rel=1e-6)
    # With far more compute than communication, one bucket each is all that shows.
    slow = _tiny(dp_overlap=True, efficiency=0.01, **kw)
    assert slow.time.dp_comm == pytest.approx(t_rs / buckets + t_ag / buckets, rel=1e-6)
    assert P.ring_bandwidth(H100, 1, 16) == 8 * H100.inter and P.ring_bandwidth(H100, 8, 16) == H100.inter
    assert P.ring_bandwidth(H100, 1, 8) == H100.intra


def test_the_ring_hides_when_a_step_covers_its_transfer():
    """Chapter 04's threshold: a causal zigzag step hides its K, V transfer once s/cp ≥ e·F/B
    (×a_kv/a): long sequences on NVLink hide, short ones over InfiniBand do not."""
    m = P.Model("tiny", layers=4, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=1024)
    c = dataclasses.replace(H100, gpus=8)
    long = P.plan(m, c, cp=8, seq_len=131072, efficiency=0.5, global_batch=8)
    assert long.comm_bytes.cp > 0 and long.time.cp_comm == 0
    ib = dataclasses.replace(H100, gpus=16, gpus_per_node=1)
    short = P.plan(m, ib, cp=16, seq_len=4096, efficiency=0.5, global_batch=16)
    assert short.crosses_nodes.cp and short.time.cp_comm > 0
    gather = P.plan(m, c, cp=8, seq_len=131072, efficiency=0.5, global_batch=8, cp_method="allgather")
    block = 131072 // 8 * 8 * 128 * 2                                               # this rank's K (or V)
    assert gather.comm_bytes.cp == pytest.approx(8 * 4 * 7 * block * 4)    # 4 layers, 8 micro-batches
    assert gather.time.cp_comm == pytest.approx(8 * 4 * 7 * block * 4 / c.intra)


def test_expert_traffic_is_deduplicated_per_node():
    """Chapter 06: DeepSeek-V3's 8 of 256 experts over 8 nodes reach 5.3 nodes; node-limited routing: 4."""
    assert round(P.expected_nodes(256, 8, 8), 1) == 5.3
    assert P.expected_nodes(256, 8, 8, limit=4) == 4
    assert P.expected_nodes(8, 1, 2) == 1
    with pytest.raises(ValueError, match="do not spread evenly"):
        P.expected_nodes(10, 4, 2)
    ds = P.MODELS["DeepSeek-V3"]
    h800 = P.CLUSTERS["2048× H800 (DeepSeek-V3's cluster)"]
    kw = dict(tp=1, pp=16, ep=64, dp=128, seq_len=4096, global_batch=15360, zero=1, efficiency=0.5)
    plain, dedup = P.plan(ds, h800, **kw), P.plan(ds, h800, dedup=True, node_limit=4, **kw)
    per_token = 8 * 56 / 64 + 8 * 7 / 64                          # assignments leaving the GPU: IB + NVLink
    assert plain.comm_bytes.ep / dedup.comm_bytes.ep == pytest.approx(per_token / (4 * 7 / 8 + 8 * 7 / 8))
    paired = P.plan(ds, h800, dedup=True, node_limit=4, ep_overlap=True, schedule="dualpipe", **kw)
    assert plain.time.ep_comm > dedup.time.ep_comm > paired.time.ep_comm > 0


def test_an_overlapped_all_to_all_needs_work_to_hide_behind_and_takes_sms_while_it_runs():
    """Overlap hides the all-to-all only behind another micro-batch (DualPipe, combined 1F1B), in the
    steady state, or failing that behind the shared experts; Mixtral has none, so there it hides nothing.
    The SMs are charged only while the all-to-all runs: overlapping is never slower than not."""
    ds, mixtral = P.MODELS["DeepSeek-V3"], P.MODELS["Mixtral 8x7B"]
    h800 = P.CLUSTERS["2048× H800 (DeepSeek-V3's cluster)"]
    kw = dict(tp=1, pp=16, ep=64, dp=128, seq_len=4096, global_batch=15360, zero=1, efficiency=0.5,
              dedup=True, node_limit=4)
    exposed = P.plan(ds, h800, **kw)
    shared = P.plan(ds, h800, ep_overlap=True, **kw)                      # 1F1B without virtual stages
    assert shared.ep_hidden_behind.startswith("the shared experts only") and shared.comm_sms == 20
    assert 0 < shared.time.ep_comm < exposed.time.ep_comm
    assert shared.time.compute == exposed.time.compute             # the SMs are not taken from every kernel
    paired = P.plan(ds, h800, ep_overlap=True, schedule="dualpipe", **kw)
    assert paired.ep_hidden_behind.startswith("DualPipe")
    free = P.plan(ds, h800, ep_overlap=True, schedule="dualpipe", comm_sms=0, **kw)
    assert 0 < free.time.ep_comm < paired.time.ep_comm < shared.time.ep_comm
    # Exactly, where every stage has the same MoE layers (Mixtral, 2 stages): 8 micro-batches per replica,
    # 2 unpaired (warm-up, cool-down) pay the whole transfer, 6 pay 20/132 of it (the SMs it holds).
    c = dataclasses.replace(H100, gpus=64)
    mk = dict(tp=1, ep=8, seq_len=4096, zero=1, global_batch=256, pp=2, dp=32, schedule="dualpipe")
    t = P.plan(mixtral, c, **mk).time.ep_comm
    assert P.plan(mixtral, c, ep_overlap=True, **mk).time.ep_comm == pytest.approx(
        6 / 8 * 20 / 132 * t + 2 / 8 * t, rel=1e-9)
    c = dataclasses.replace(H100, gpus=64)
    mk = dict(tp=1, ep=8, seq_len=4096, zero=1, global_batch=64)
    alone = P.plan(mixtral, c, pp=2, dp=32, ep_overlap=True, **mk)
    assert alone.ep_hidden_behind.startswith("nothing")
    assert alone.time.ep_comm == pytest.approx(P.plan(mixtral, c, pp=2, dp=32, **mk).time.ep_comm)
    combined = P.plan(mixtral, c, pp=1, dp=64, ep_overlap=True, comm_sms=0, **dict(mk, global_batch=128))
    assert combined.ep_hidden_behind.startswith("combined 1F1B")      # 2 micro-batches: the first forward and
    plain = P.plan(mixtral, c, pp=1, dp=64, **dict(mk, global_batch=128))    # the last backward run alone
    assert combined.time.ep_comm == pytest.approx(plain.time.ep_comm / 2)
    full = P.plan(mixtral, c, pp=1, dp=64, ep_overlap=True, recompute="full", **dict(mk, global_batch=128))
    assert full.ep_hidden_behind.startswith("nothing")               # Megatron-Core refuses it with full recompute
    assert P.plan(ds, h800, ep_overlap=True, recompute="full", **dict(kw, pp=1, dp=2048, global_batch=4096)
                  ).ep_hidden_behind.startswith("the shared experts only")
    assert P.plan(mixtral, c, pp=2, dp=32, vpp=2, ep_overlap=True, **mk).ep_hidden_behind.startswith("combined")
    auto = P.plan(mixtral, c, pp=2, dp=32, ep_overlap="auto", **mk)            # nothing to hide behind: off
    assert auto.ep_hidden_behind == "" and auto.comm_sms == 0
    with pytest.raises(ValueError, match="ep_overlap must be True, False or 'auto'"):
        P.plan(mixtral, c, pp=2, dp=32, ep_overlap="always", **mk)


def test_paired_fraction():
    assert P.paired_fraction(P._COMBINED, 1, 8) == 7 / 8
    assert P.paired_fraction(P._DUALPIPE, 16, 64) == 48 / 64
    assert P.paired_fraction(P._DUALPIPE, 16, 8) == 0.0
    assert P.paired_fraction(P._SHARED, 1, 8) == P.paired_fraction("", 1, 8) == 0.0


def test_the_busiest_expert_rank_sets_the_pace():
    mixtral, c = P.MODELS["Mixtral 8x7B"], dataclasses.replace(H100, gpus=64)
    mk = dict(tp=1, ep=8, pp=1, dp=64, seq_len=4096, zero=1, global_batch=64)
    even, skewed = P.plan(mixtral, c, **mk), P.plan(mixtral, c, ep_imbalance=1.5, **mk)
    assert skewed.time.ep_comm == pytest.approx(1.5 * even.time.ep_comm)
    assert even.time.compute < skewed.time.compute < 1.5 * even.time.compute   # attention is not routed
    assert skewed.comm_bytes == even.comm_bytes and skewed.mfu < even.mfu
    for bad in (0.9, True, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ep_imbalance is the busiest rank's tokens over the mean"):
            P.plan(mixtral, c, ep_imbalance=bad, **mk)


def test_search_charges_expert_parallel_communication_and_searches_etp():
    """No layout search returns has its all-to-all charged as zero without a partner to overlap with;
    an overlapped one says what it was hidden behind and pays its SMs; etp is searched."""
    found = P.search(P.MODELS["Mixtral 8x7B"], H100, seq_len=4096, global_batch=256, gpus=64)
    moe_layouts = [(kw, pl) for kw, pl in found if kw["ep"] > 1]
    assert moe_layouts and {kw["etp"] for kw, _ in found} > {1}
    assert any(pl.ep_hidden_behind for _, pl in moe_layouts) and not all(pl.ep_hidden_behind for _, pl in moe_layouts)
    for kw, pl in moe_layouts:
        assert pl.comm_sms == (P.EP_COMM_SMS if pl.ep_hidden_behind else 0), kw
        assert pl.time.ep_comm > 0 or pl.ep_hidden_behind.startswith(("DualPipe", "combined 1F1B")), kw


def test_sm_share_and_fp8_change_only_what_they_touch():
    ds = P.MODELS["DeepSeek-V3"]
    h800 = P.CLUSTERS["2048× H800 (DeepSeek-V3's cluster)"]
    kw = dict(tp=1, pp=16, ep=64, dp=128, seq_len=4096, global_batch=15360, zero=1, efficiency=0.5)
    base, sms = P.plan(ds, h800, **kw), P.plan(ds, h800, comm_sms=20, **kw)
    assert sms.time.compute == base.time.compute         # SMs are held only while an all-to-all runs
    shared, taxed = (P.plan(ds, h800, ep_overlap=True, comm_sms=n, **kw) for n in (0, 20))
    assert shared.time.ep_comm <= taxed.time.ep_comm < base.time.ep_comm   # a short shared expert: equal
    fp8 = P.plan(ds, h800, fp8=True, **kw)
    assert base.time.compute / 2 < fp8.time.compute < base.time.compute     # attention, head stay bf16
    # with the calibrated curve, FP8 halves only the matrix products, not the n_half/n rest
    curve = P.KERNEL_CURVES["Hopper"]
    n = P.gemm_size(ds, 1, 1, True)
    assert curve(n) == pytest.approx(curve.eta_max * n / (n + curve.n_half))


def test_efficiency_none_means_the_calibrated_curve():
    c = dataclasses.replace(H100, gpus=64)
    m = P.MODELS["Llama 3 70B"]
    kw = dict(tp=8, sp=True, pp=8, seq_len=8192, global_batch=64)
    eta = P.KERNEL_CURVES["Hopper"](P.gemm_size(m, 8))
    assert P.plan(m, c, **kw).efficiency.dense == pytest.approx(eta)
    assert P.plan(m, c, efficiency=0.3, **kw).efficiency.dense == 0.3
    with pytest.raises(ValueError, match="no calibrated kernel model for Blackwell"):
        P.plan(m, dataclasses.replace(P.CLUSTERS["GB200 NVL72 (one rack)"], gpus=64), **kw)
    assert P.plan(m, dataclasses.replace(P.CLUSTERS["GB200 NVL72 (one rack)"], gpus=64), efficiency=0.5, **kw).fits


def test_time_adds_up_and_search_sorts():
    pl = P.plan(P.MODELS["Llama 3 70B"], dataclasses.replace(H100, gpus=64), tp=8, sp=True, pp=2, dp=4,
                seq_len=8192, global_batch=64)
    assert math.isclose(pl.time.total, sum(v for _, v in pl.time.parts()))
    found = P.search(P.MODELS["Llama 3 70B"], H100, seq_len=8192, global_batch=256, gpus=64)
    times = [p.time.total for _, p in found]
    assert found and times == sorted(times) and all(p.fits and p.gpus == 64 for _, p in found)


# ---------------------------------------------------------------------------- the published record

def test_the_stored_curves_are_the_fit():
    """calibrate() through the two fit runs reproduces KERNEL_CURVES (no number drifts from its fit)."""
    for generation, stored in P.KERNEL_CURVES.items():
        fitted = P.calibrate(generation)
        assert fitted.eta_max == pytest.approx(stored.eta_max, abs=2e-4), generation
        assert fitted.n_half == pytest.approx(stored.n_half, abs=0.5), generation
        assert set(fitted.fitted_on) == set(stored.fitted_on)
        for run in P.RECORD:
            if run.role == "fit" and run.cluster.generation == generation:
                assert abs(run.residual()) < 1e-3, run.name


def test_the_record_is_verified_and_held_out_runs_agree():
    """Every run with a complete layout is predicted within ±15 % but Llama 3's 128K run, whose
    residual chapter 08 explains (attention's kernels); DeepSeek-V3's published figure is a floor
    (GPU-hours), and the prediction lies above it; the fit and test runs are disjoint."""
    runs = [r for r in P.RECORD if r.role in ("fit", "test")]
    assert len(runs) >= 10 and len({r.name for r in runs}) == len(runs)
    assert {r.role for r in runs} == {"fit", "test"}
    published = {r.name: r.published for r in runs}
    assert published["Korthikanti 175B"] == 0.514 and published["Korthikanti 530B"] == 0.560
    assert published["Korthikanti 1T"] == 0.563 and published["Korthikanti 22B"] == 0.415
    assert published["Korthikanti 530B, dp = 8"] == 0.542
    assert round(published["Llama 3 405B, 8,192 GPUs, 8K"], 2) == 0.43
    assert round(published["Llama 3 405B, 16,384 GPUs, 128K"], 2) == 0.38
    assert round(published["Narayanan 1.7B"] * 312) == 137
    outside = {r.name: round(r.residual(), 3) for r in runs if abs(r.residual()) > 0.15}
    assert set(outside) == {"Llama 3 405B, 16,384 GPUs, 128K"}, outside
    assert 0.35 < outside["Llama 3 405B, 16,384 GPUs, 128K"] < 0.55
    # DeepSeek-V3's MFU is derived from GPU-hours, which include whatever the run spent besides steps:
    # a floor on the steps' MFU, so the planner's prediction lies above it.
    ds = next(r for r in runs if r.name.startswith("DeepSeek-V3"))
    assert 0.12 < ds.residual() < 0.15


def test_nccl_latency_is_its_tuning_model():
    """NCCL's Simple-protocol latencies (src/graph/tuning.cc): a ring's grows with every rank, 2(n−1)
    steps for an all-reduce, 2(nodes−1) of them across the network, ×1.4 across nodes; a tree's with
    log2 of the nodes."""
    us = lambda *a: C.nccl_latency(*a) * 1e6                                             # noqa: E731
    assert us("all_reduce", 8, 1, "ring") == pytest.approx(8.4 + 14 * 3.4)
    assert us("all_reduce", 128, 16, "ring") == pytest.approx((8.4 + 224 * 3.4 + 30 * 14) * 1.4)
    assert us("reduce_scatter", 128, 16, "ring") == pytest.approx(8.4 + 112 * 3.4 + 15 * 14)
    assert us("all_reduce", 128, 16, "tree") == pytest.approx(8.4 + 2 * (7 * 4.0 + 4 * 14))
    assert us("all_reduce", 1024, 1024, "tree") == pytest.approx(8.4 + 2 * 10 * 14)
    assert us("all_reduce", 1, 1, "ring") == 0
    # The faster in this Simple-protocol model: the ring for a large all-reduce on a few nodes, the tree
    # once the ring's latency outgrows the tree's lower bandwidth; inside one node the model takes the
    # ring (NCCL's tuner never picks its single-node chain there), and a reduce-scatter only the ring.
    assert C.nccl_time("all_reduce", 160e6, 16, 2, 50e9)[1] == "ring"
    assert C.nccl_time("all_reduce", 160e6, 512, 512, 50e9)[1] == "tree"
    assert C.nccl_time("all_reduce", 1e6, 16, 16, 50e9)[1] == "tree"
    assert C.nccl_time("reduce_scatter", 1e6, 512, 512, 50e9)[1] == "ring"
    ring = C.nccl_time("all_reduce", 160e6, 16, 2, 50e9, "ring")[0]
    assert ring == pytest.approx(C.nccl_latency("all_reduce", 16, 2) + 2 * 15 / 16 * 160e6 / 50e9)
    tree = C.nccl_time("all_reduce", 160e6, 512, 512, 50e9, "tree")[0]     # 2.5 M × 64 B: correction 0.9
    # one GPU per node: NCCL's tree pattern costs another 0.85 of the bandwidth
    assert tree == pytest.approx(C.nccl_latency("all_reduce", 512, 512, "tree")
                                 + 2 * 160e6 / (0.92 * 0.85 * 50e9 * 0.9))
    two_per_node = C.nccl_time("all_reduce", 160e6, 1024, 512, 50e9, "tree")[0]
    assert two_per_node == pytest.approx(C.nccl_latency("all_reduce", 1024, 512, "tree")
                                         + 2 * 160e6 / (0.92 * 50e9 * 0.9))
    # AMD hosts: a 2 µs network overhead, tripled, is more than an NVLink step
    assert us("all_reduce", 16, 2, "ring") == pytest.approx((8.4 + 28 * 3.4 + 2 * 14) * 1.4)   # 30 steps, 2 between nodes
    assert C.nccl_latency("all_reduce", 16, 2, "ring", net_overhead_us=2.0) * 1e6 == pytest.approx(
        (8.4 + 28 * 6.0 + 2 * 14) * 1.4)
    for bad, words in ((lambda: C.nccl_latency("all_to_all", 8), "covers all_reduce"),
                       (lambda: C.nccl_latency("all_reduce", 4, 8), "cannot exceed"),
                       (lambda: C.nccl_latency("all_gather", 16, 2, "tree"), "tree runs all-reduces only")):
        with pytest.raises(ValueError, match=words):
            bad()


def test_buckets_grow_with_the_data_parallel_group_and_the_last_one_shows():
    assert P.ddp_bucket_elements(16) == 40_000_000 and P.ddp_bucket_elements(128) == 128_000_000
    assert P.group_nodes(H100, 8, 128) == 128 and P.group_nodes(H100, 1, 16) == 2 and P.group_nodes(H100, 1, 4) == 1
    assert P.group_nodes(H100, 1, 12) == 2 and P.group_nodes(H100, 3, 6) == 2 and P.group_nodes(H100, 16, 4) == 4
    # The same model on more replicas: the exposed last bucket grows with the ring's latency and size.
    m = P.MODELS["GPT-3 175B"]
    small, large = (P.plan(m, H100, tp=8, pp=8, dp=d, zero=1, global_batch=8 * d, seq_len=2048) for d in (4, 16))
    assert large.time.dp_comm > small.time.dp_comm > 0
    assert large.mfu < small.mfu                       # 4× the replicas, the same work each: MFU falls
    # without NCCL's latency (bandwidth alone), the exposed time would not grow with the group
    flat = [P.plan(m, H100, tp=8, pp=8, dp=d, zero=1, global_batch=8 * d, seq_len=2048, dp_latency=False)
            for d in (4, 16)]
    assert flat[1].time.dp_comm - flat[0].time.dp_comm < large.time.dp_comm - small.time.dp_comm
    # Megatron-LM buckets only when it overlaps; otherwise one call over the whole buffer
    assert P.bucketed("all_reduce", 1e9, 4, 16, 2, 50e9, overlapped=False)[2] == 1
    assert P.bucketed("all_reduce", 1e9, 4, 16, 2, 50e9)[2] == 25


def test_stragglers_wait_for_the_slowest_gpu():
    assert P.expected_max_normal(1) == 0 and P.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    e = [P.expected_max_normal(n) for n in (8, 64, 1024, 16384)]
    assert e == sorted(e) and all(v < math.sqrt(2 * math.log(n)) for v, n in zip(e, (8, 64, 1024, 16384)))
    base, slow = _tiny(dp=16, global_batch=64), _tiny(dp=16, global_batch=64, straggler_sigma=0.02)
    assert slow.time.stragglers == pytest.approx(0.02 * P.expected_max_normal(16) * base.time.compute)
    assert base.time.stragglers == 0 and slow.mfu < base.mfu
    assert _tiny(dp=16, global_batch=64, straggler_sigma=0.0).time == base.time       # zero spread: nothing
    with pytest.raises(ValueError, match="straggler_sigma"):
        _tiny(straggler_sigma=-0.1)


def test_deepseek_mfu_is_derived_from_its_gpu_hours():
    """180K H800-hours per trillion tokens: 1543 tokens per GPU-second at 2.81e11 FLOPs each."""
    f = P.flops_per_token(P.MODELS["DeepSeek-V3"], 4096)["model"]
    assert P.deepseek_v3_mfu() == pytest.approx(f * 1e12 / (180e3 * 3600) / 989e12)
    assert 0.43 < P.deepseek_v3_mfu() < 0.45


def test_published_layouts_that_trained_fit():
    for run in P.RECORD:
        assert run.plan().fits, run.name
    # Llama 3's FSDP shards the gradients with the optimizer states (ZeRO-2); with Megatron's whole
    # fp32 gradient buffer (ZeRO-1) its first stage, at the default G = pp = 16, would not fit
    llama = {r.name: r for r in P.RECORD}["Llama 3 405B, 8,192 GPUs, 8K"]
    assert llama.layout["zero"] == 2
    whole = P.plan(llama.model, llama.cluster, **dict(llama.layout, zero=1))
    assert not whole.fits and whole.mfu == llama.plan().mfu


def test_zero_2_reduce_scatters_every_micro_batch():
    """ZeRO-2 keeps a shard of the gradients: each of the m micro-batches reduce-scatters its own,
    behind the next one's compute (the last behind its own backward); ZeRO-1 reduces once."""
    kw = dict(dp=16, global_batch=64, dp_overlap=False)
    z1, z2 = _tiny(zero=1, **kw), _tiny(zero=2, **kw)
    t_rs, t_ag, _, bw = _tiny_dp_times(overlapped=False)
    assert z2.time.dp_comm - z1.time.dp_comm == pytest.approx(3 * t_rs)           # 4 micro-batches
    assert z2.comm_bytes.dp - z1.comm_bytes.dp == pytest.approx(
        3 * P.bus_factor("reduce_scatter", 16) * _TINY_PARAMS * 4)
    assert z2.memory_bytes.gradients == pytest.approx(z1.memory_bytes.gradients / 16)
    on = _tiny(zero=2, dp=16, global_batch=64, dp_overlap=True)
    t_rs, t_ag, buckets, _ = _tiny_dp_times()
    per_mb = on.time.compute / 4
    assert on.time.dp_comm == pytest.approx(3 * max(0, t_rs - per_mb) + max(t_rs / buckets, t_rs - per_mb * 2 / 3)
                                               + max(t_ag / buckets, t_ag - per_mb / 3), rel=1e-6)
    z3 = _tiny(zero=3, **kw)
    t_rs, t_ag, _, _ = _tiny_dp_times(overlapped=False)
    assert z3.time.dp_comm == pytest.approx(4 * t_rs + 8 * t_ag)                      # gathers: fwd, bwd


def test_brackets_hold_the_readme_runs():
    """The Megatron-Core README leaves micro-batch and interleaving open: each published MFU lies
    within 15 % of the planner's range over them."""
    for run in (r for r in P.RECORD if r.role == "bracket"):
        (lo, _), (hi, best) = P.bracket(run)
        assert lo <= hi
        assert lo * 0.85 <= run.published <= hi * 1.15, (run.name, lo, hi, run.published)


def test_the_chapter_explorer_grid_answers_or_explains():
    """Every combination of chapter 08's explorer gives a plan or a ValueError naming a rule."""
    import itertools
    answered = refused = 0
    for name, cluster, tp, cp, ep, pp, rc in itertools.product(
            P.MODELS, ["1024× H100 (128 nodes of 8, InfiniBand)", "A100 cluster (nodes of 8, InfiniBand HDR)"],
            [1, 2, 4, 8], [1, 2, 4], [1, 8, 64], [1, 2, 4, 8], ["none", "full"]):
        c = dataclasses.replace(P.CLUSTERS[cluster], gpus=64)
        dp = 64 // (tp * cp * pp)
        try:
            pl = P.plan(P.MODELS[name], c, tp=tp, sp=tp > 1, cp=cp, ep=ep, pp=pp, dp=dp, seq_len=8192,
                        recompute=rc, zero=1, global_batch=max(64, dp * pp), ep_overlap="auto")
            assert pl.memory_bytes.total > 0 and pl.time.total > 0 and 0 < pl.mfu < 1
            answered += 1
        except ValueError as err:
            assert str(err)
            refused += 1
    assert answered and refused


def test_mesh_demo_matches_the_dense_model_on_a_2x2_grid(pool):
    """TP+SP within tp pairs, EP across dp pairs, DP over batches: output and every gradient."""
    result = pool("intralayer.programs.mesh_demo", 4, timeout=120)
    assert "all checks passed on every rank" in result.output
    assert "(1, 1)" in result.output


def test_mesh_demo_refuses_a_grid_it_cannot_form(pool):
    from intralayer import launch
    with pytest.raises(launch.LaunchError, match="2 × 2 grid"):
        pool("intralayer.programs.mesh_demo", 2, timeout=60)


def test_independent_rows_are_the_other_papers_held_out_runs():
    """Held out from the fit's own paper is not independent: on Ampere only Narayanan et al.'s rows are,
    on Hopper only DeepSeek-V3 (Llama 3's fit run shares its paper with the other two Llama rows)."""
    independent = {r.name for r in P.RECORD if P.independent_of_fit(r)}
    assert independent == {"Narayanan 1.7B", "Narayanan 3.6B", "Narayanan 7.5B", "Narayanan 18.4B",
                           "DeepSeek-V3, 2,048 H800"}
    assert not any(P.independent_of_fit(r) for r in P.RECORD if r.role in ("fit", "bracket"))


def test_the_plan_is_the_sum_of_its_pieces():
    """Each piece on its own, from one Layout: plan's time is theirs added up for the slowest stage."""
    m = P.Model("tiny", layers=16, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=1024)
    cluster = dataclasses.replace(H100, gpus=16)
    lay = P.Layout(m, cluster, tp=8, sp=True, dp=2, global_batch=4, efficiency=0.5, seq_len=1024,
                   tp_overlap="none", dp_overlap=False)
    pl = P.plan_of(lay)
    L = P.layer_time(lay)
    assert L.bwd == 2 * L.fwd and L.again == 0 and L.total == 3 * L.fwd
    tp = P.tp_cost(lay, L)
    one = P.bus_factor("all_reduce", 8) * 1024 * 1024 * 2                 # s·b·h bf16, ring bytes
    assert tp.sent == 5 * one and tp.exposed == pytest.approx(5 * one / H100.intra)   # SP: 2 re-gathers backward
    head, _ = P.head_time(lay)
    assert lay.micro_batches == 2 and pl.time.compute == pytest.approx(2 * (16 * L.total + head))
    assert pl.time.tp_comm == pytest.approx(2 * 16 * tp.exposed)
    dp, algorithm = P.dp_cost(lay, 16 * L.fwd + head / 3, 16 * L.bwd + 2 * head / 3)
    assert pl.time.dp_comm == pytest.approx(dp.exposed) and algorithm == "ring"
    assert P.cp_cost(lay, L) == P.Cost(0.0, 0.0) and P.ep_cost(lay, L) == P.Cost(0.0, 0.0)
    assert P.pipeline_cost(lay, 1.0) == (0.0, P.Cost(0.0, 0.0))
    assert pl.memory_bytes == P.stage_memory(lay)
    costs = P.layer_costs(lay)
    assert costs.time == L and costs.tp == tp and costs.ep == P.Cost(0.0, 0.0)
    stage = P.stage_time(lay.stages[0], costs, None, head)
    assert lay.stages == [(16, 0, True)] and stage.compute == pytest.approx(16 * L.total + head)
    assert stage.busy == pytest.approx(stage.compute + 16 * tp.exposed)
    assert P.plan(m, cluster, tp=8, sp=True, dp=2, global_batch=4, efficiency=0.5, seq_len=1024,
                  tp_overlap="none", dp_overlap=False).time == pl.time
    # a Layout refuses what plan refuses, in the same words
    with pytest.raises(ValueError, match="not divisible by tp=3|does not divide"):
        P.Layout(m, cluster, tp=3)
    for bad, words in ((dict(grad_bytes=3), "grad_bytes must be 2"), (dict(optimizer_bytes=-5), "optimizer_bytes"),
                       (dict(node_limit=-2), "node_limit")):
        with pytest.raises(ValueError, match=words):
            P.Layout(m, cluster, **bad)
    piped = P.Layout(m, cluster, tp=8, pp=2, global_batch=8, efficiency=0.5, seq_len=1024)
    bubble, p2p = P.pipeline_cost(piped, 2.0)
    assert bubble == pytest.approx(2.0) and p2p.sent == 2 * 1024 * 1024 * 2


def test_step_time_is_typed_and_adds_up_in_order():
    pl = _tiny(dp=16, global_batch=64, straggler_sigma=0.02)
    t = pl.time
    assert isinstance(t, P.StepTime) and t.stragglers > 0
    assert t.total == sum(v for _, v in t.parts())                 # the same additions, in the same order
    assert [label for label, _ in t.parts()] == ["compute", "bubble", "tp comm", "cp comm", "ep comm", "pp comm",
                                                 "dp comm", "stragglers"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.compute = 0.0
    with pytest.raises(TypeError):                                   # no string keys: the fields are the API
        t["tp comm"]


def _check_stack_band(band):
    """What a stack band must do, for ``band(cluster, stack, efficiency)``: nothing on the stacks a curve was
    fitted on, or when no stack is named, or with the caller's own efficiency; MegaScale's 1.34 elsewhere."""
    ampere, hopper = P.CLUSTERS[P._A100], P.CLUSTERS[P._H100]
    assert band(ampere, P.MEGATRON) == 1.0 and band(ampere, None) == 1.0
    assert band(hopper, P.LLAMA3_STACK) == 1.0 and band(hopper, P.MEGATRON) == 1.0
    assert band(ampere, P.LLAMA3_STACK) == 1.34 and band(hopper, P.HAI_LLM) == 1.34     # not fitted on there
    assert band(hopper, P.HAI_LLM, 0.5) == 1.0                                          # the caller's own number
    assert band(hopper, P.MEGATRON, P.KernelCurve(0.5, 1000.0)) == 1.34                 # a curve of no stack


def test_a_run_on_another_stack_is_predicted_as_a_range():
    _check_stack_band(P.stack_band)
    assert P.STACK_BAND == 1.34 and "1.34" in P.STACK_BAND_SOURCE and "55.2%" in P.STACK_BAND_SOURCE
    other = [r for r in P.RECORD if r.role == "test" and not r.on_fitted_stack()]
    assert [r.name for r in other] == ["DeepSeek-V3, 2,048 H800"] and other[0].stack == P.HAI_LLM
    ds = other[0]
    low, high = ds.predicted_range()
    assert low == pytest.approx(ds.predicted() / 1.34) and high == pytest.approx(ds.predicted() * 1.34)
    assert low <= ds.published <= high
    pl = ds.plan()
    assert pl.stack == P.HAI_LLM and pl.band == 1.34
    assert pl.time_range == (pl.time.total / 1.34, pl.time.total * 1.34)
    # the band leaves the prediction itself alone
    same = P.plan(ds.model, ds.cluster, **ds.layout)
    assert same.band == 1.0 and same.mfu == pl.mfu and same.time == pl.time and same.mfu_range == (pl.mfu, pl.mfu)
    for r in P.RECORD:                       # every other run is on a stack its curve was fitted on: a point
        if r is not ds:
            assert r.on_fitted_stack() and r.predicted_range() == (r.predicted(), r.predicted()), r.name
    with pytest.raises(ValueError, match="stack must name a software stack"):
        _tiny(stack="")


def test_the_stack_band_check_rejects_wrong_bands():
    """The check above fails on plausible wrong answers: a band everywhere, the factor inverted, a band read
    off the two MFUs' difference rather than their ratio."""
    everywhere = lambda c, stack, eff=None: 1.0 if stack is None else P.STACK_BAND                  # noqa: E731
    inverted = lambda c, stack, eff=None: 1 / P.stack_band(c, stack, eff)                           # noqa: E731
    difference = lambda c, stack, eff=None: (1 + (0.552 - 0.552 / 1.34)                            # noqa: E731
                                             if P.stack_band(c, stack, eff) > 1 else 1.0)
    for wrong in (everywhere, inverted, difference):
        with pytest.raises(AssertionError):
            _check_stack_band(wrong)


def test_the_plans_other_results_are_typed_frozen_and_add_up_in_order():
    """Memory, bytes sent, node crossings, FLOPs and efficiencies are frozen dataclasses with fields, not
    dicts: each sums its components left to right, and an old-style string key fails."""
    ds = next(r for r in P.RECORD if r.name.startswith("DeepSeek"))
    pl = ds.plan()
    lay = P.Layout(ds.model, ds.cluster, **ds.layout, stack=ds.stack)
    mem, comm, cross, fl, eta = pl.memory_bytes, pl.comm_bytes, pl.crosses_nodes, pl.flops, pl.efficiency
    assert (type(mem), type(comm), type(cross), type(fl), type(eta)) == \
        (P.Memory, P.CommBytes, P.CrossesNodes, P.StepFlops, P.Efficiency)
    assert mem.total == ((mem.weights + mem.gradients) + mem.optimizer) + mem.activations
    assert [k for k, _ in mem.parts()] == ["weights", "gradients", "optimizer", "activations"]
    assert mem.total == sum(v for _, v in mem.parts()) and mem.capacity == ds.cluster.memory == 80e9
    assert pl.fits == (mem.total <= mem.capacity) and mem == P.stage_memory(lay)
    assert [k for k, _ in comm.parts()] == ["tp", "cp", "ep", "pp", "dp"]
    assert comm.ep > 0 and comm.pp > 0 and comm.dp > 0                   # the DeepSeek-V3 layout uses all three
    assert comm.total == (((comm.tp + comm.cp) + comm.ep) + comm.pp) + comm.dp
    assert cross == lay.crosses_nodes and cross.ep and not cross.tp       # ep = 64 leaves the node; tp = 1 does not
    assert lay.bandwidth("ep") == ds.cluster.inter and lay.bandwidth("tp") == ds.cluster.intra
    tokens = ds.layout["global_batch"] * ds.layout["seq_len"]
    assert fl.model == P.flops_per_token(ds.model, ds.layout["seq_len"])["model"] * tokens
    assert pl.mfu == fl.model / (pl.time.total * pl.gpus * ds.cluster.peak)
    assert eta.moe == P.kernel_efficiency(ds.cluster, P.layer_size(lay, True)) and 0 < eta.dense < 1
    assert eta.head == P.head_time(lay)[1]
    assert _tiny().efficiency.moe is None                                 # a dense model has no MoE layers
    for result, field in ((mem, "weights"), (comm, "tp"), (cross, "tp"), (fl, "model"), (eta, "dense")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(result, field, 0)
    for result, key in ((mem, "total"), (comm, "tp"), (cross, "dp"), (fl, "model"), (eta, "dense")):
        with pytest.raises(TypeError):                                    # no string keys: the fields are the API
            result[key]
