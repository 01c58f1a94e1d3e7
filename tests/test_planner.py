"""intralayer.planner (chapter 08): presets, the rules, and the arithmetic."""
from __future__ import annotations

import math

import pytest

from intralayer import memory, moe
from intralayer import planner as P

H100 = P.CLUSTERS["1024× H100 (128 nodes of 8, InfiniBand)"]


def test_presets_count_the_published_sizes():
    assert round(P.params(P.MODELS["Mixtral 8x7B"])["total"] / 1e9, 1) == 46.7
    assert round(P.params(P.MODELS["DeepSeek-V3"])["total"] / 1e9) == 671
    gpt3 = P.params(P.MODELS["GPT-3 175B"])["total"]
    assert 174e9 < gpt3 < 176e9, gpt3
    assert 69e9 < P.params(P.MODELS["Llama 3 70B"])["total"] < 72e9
    assert 400e9 < P.params(P.MODELS["Llama 3 405B"])["total"] < 410e9
    for c in P.CLUSTERS.values():
        assert c.gpus % c.gpus_per_node == 0 and c.memory > 0 and c.peak > 0


@pytest.mark.parametrize("kw, rule", [
    (dict(tp=3), "does not divide the cluster"),
    (dict(tp=64), "attention heads are not divisible by tp=64"),
    (dict(pp=128), "more than the model's 96 layers"),
    (dict(cp=2, seq_len=2050), "not divisible by 2·cp"),
    (dict(sp=True), "sequence parallelism needs tp > 1"),
    (dict(ep=2, dp=2), "needs a mixture-of-experts model"),
    (dict(recompute="some"), "recompute must be one of"),
    (dict(zero=4), "zero must be 0, 1, 2 or 3"),
    (dict(tp=0), "tp must be a whole number"),
])
def test_invalid_layouts_name_the_rule(kw, rule):
    with pytest.raises(ValueError, match=rule):
        P.plan(P.MODELS["GPT-3 175B"], H100, **kw)


def test_memory_follows_the_formulas():
    m = P.MODELS["GPT-3 175B"]
    base = P.plan(m, H100, tp=8, sp=True, pp=8, dp=16, seq_len=2048, global_batch=1536)
    p = P.params(m)
    local = p["dense"] * (12 / 96) / 8 + p["embedding"] / 16
    assert math.isclose(base.memory_bytes["weights"], 2 * local)
    assert math.isclose(base.memory_bytes["optimizer"], 12 * local)
    z1 = P.plan(m, H100, tp=8, sp=True, pp=8, dp=16, seq_len=2048, global_batch=1536, zero=1)
    assert math.isclose(z1.memory_bytes["optimizer"], 12 * local / 16)                  # sharded over dp
    z3 = P.plan(m, H100, tp=8, sp=True, pp=8, dp=16, seq_len=2048, global_batch=1536, zero=3)
    assert math.isclose(z3.memory_bytes["weights"], 2 * local / 16)
    # GPT-3 is MHA with a GeLU MLP of 4h: the activations are Korthikanti's, fused attention, 96 layers' worth
    per_layer = sum(memory.activation_terms(2048, 1, 12288, 96, t=8, sp=True, fused=True).values())
    assert math.isclose(base.memory_bytes["activations"], 96 * per_layer)
    assert base.memory_bytes["total"] == pytest.approx(sum(base.memory_bytes[k] for k in
                                                           ("weights", "gradients", "optimizer", "activations")))


def test_communication_follows_the_formulas():
    m = P.MODELS["GPT-3 175B"]
    pl = P.plan(m, H100, tp=8, pp=8, dp=16, seq_len=2048, global_batch=1536)
    mb = 1536 // 16
    sbh = 2048 * 12288 * 2
    assert math.isclose(pl.comm_bytes["tp"], 4 * 1.75 * sbh * 12 * mb)                  # 4 all-reduces, 12 layers
    assert pl.crosses_nodes == dict(tp=False, cp=False, ep=False, dp=True, pp=True)
    assert pl.comm_bytes["ep"] == 0 and pl.comm_bytes["cp"] == 0


def test_time_and_mfu_are_consistent():
    m = P.MODELS["Llama 3 70B"]
    pl = P.plan(m, H100, tp=8, sp=True, pp=2, dp=4, seq_len=8192, global_batch=64)
    t = pl.time
    assert math.isclose(t["total"], sum(v for k, v in t.items() if k != "total"))
    assert 0 < pl.mfu < 0.5                                      # at most the assumed 50% efficiency
    assert math.isclose(t["bubble"], t["compute"] * (2 - 1) / (64 // 4))


def test_search_returns_fitting_layouts_fastest_first():
    found = P.search(P.MODELS["Llama 3 70B"], H100, seq_len=8192, global_batch=256, gpus=64)
    assert found
    times = [pl.time["total"] for _, pl in found]
    assert times == sorted(times)
    assert all(pl.fits and pl.gpus == 64 for _, pl in found)


def test_deepseek_v3_published_layout_is_valid():
    cluster = P.Cluster("2048× H800", gpus=2048, gpus_per_node=8, memory=80e9, intra=160e9, inter=50e9,
                        peak=989e12)
    pl = P.plan(P.MODELS["DeepSeek-V3"], cluster, tp=1, ep=64, pp=16, dp=128, seq_len=4096, global_batch=15360 // 4,
                zero=1)
    assert pl.gpus == 2048 and pl.comm_bytes["ep"] > 0 and pl.comm_bytes["tp"] == 0
    assert moe.DEEPSEEK_V3.layers == 61


def test_mesh_demo_matches_the_dense_model_on_a_2x2_grid():
    """TP+SP within tp pairs, EP across dp pairs, DP over batches: output and every gradient."""
    from intralayer import launch
    result = launch.run("intralayer.programs.mesh_demo", 4, timeout=120, show=False)
    assert "all checks passed on every rank" in result.output
    assert "(1, 1)" in result.output


def test_mesh_demo_refuses_a_grid_it_cannot_form():
    from intralayer import launch
    with pytest.raises(launch.LaunchError, match="2 × 2 grid"):
        launch.run("intralayer.programs.mesh_demo", 2, timeout=60, show=False)


def test_the_chapter_explorer_grid_answers_or_explains():
    """Every combination of chapter 08's explorer gives a plan or a ValueError naming a rule."""
    import dataclasses
    import itertools
    answered = refused = 0
    for name, cluster, tp, cp, ep, pp, rc in itertools.product(
            P.MODELS, ["1024× H100 (128 nodes of 8, InfiniBand)", "GB200 NVL72 (one rack)"], [1, 2, 4, 8], [1, 2, 4],
            [1, 8, 64], [1, 2, 4, 8], ["none", "selective", "full"]):
        c = dataclasses.replace(P.CLUSTERS[cluster], gpus=64)
        dp = 64 // (tp * cp * pp)
        try:
            pl = P.plan(P.MODELS[name], c, tp=tp, sp=tp > 1, cp=cp, ep=ep, pp=pp, dp=dp, seq_len=8192,
                        recompute=rc, zero=1, global_batch=max(64, dp * pp))
            assert pl.memory_bytes["total"] > 0 and pl.time["total"] > 0 and 0 < pl.mfu < 1
            answered += 1
        except ValueError as err:
            assert str(err)
            refused += 1
    assert answered and refused
