"""Wrong answers to lab 08 (a t × d mesh: placing its groups, one TP + DP training step) and its bug hunt (MFU)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from intralayer import comm, planner


# ------------------------------------------------------------------ mesh_ranks

def place_swapped(ranks, tp):
    """TP groups strided, DP groups consecutive: the axes swapped."""
    d = len(ranks) // tp
    return [list(ranks[i::d]) for i in range(d)], [list(ranks[j * d:(j + 1) * d]) for j in range(tp)]


def place_from_zero(ranks, tp):
    """Numbers the ranks 0 … n−1 instead of using the group's process numbers."""
    n = len(ranks)
    d = n // tp
    return [list(range(i * tp, (i + 1) * tp)) for i in range(d)], [list(range(j, n, tp)) for j in range(tp)]


def place_ignores_tp(ranks, tp):
    """Always pairs of ranks, whatever t is."""
    return [list(ranks[i:i + 2]) for i in range(0, len(ranks), 2)], [list(ranks[j::2]) for j in range(2)]


def place_by_gathering(ranks, tp):
    """Asks every rank for its number first: communication that placing does not need."""
    mine = torch.tensor([float(dist.get_rank())])
    everyone = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)                                         # it has no group: the default one
    d = len(ranks) // tp
    return [list(ranks[i * tp:(i + 1) * tp]) for i in range(d)], [list(ranks[j::tp]) for j in range(tp)]


# ------------------------------------------------------------------ tp_dp_step

def _shard(fc1, fc2, tp_group):
    t, i = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    f = fc1.out_features // t
    cols = slice(i * f, (i + 1) * f)

    def own(w):
        return w.detach().clone().requires_grad_()

    return {"w1": own(fc1.weight[cols]), "b1": own(fc1.bias[cols]), "w2": own(fc2.weight[:, cols]),
            "b2": own(fc2.bias)}


def _forward(p, x, tp_group):
    hidden = F.gelu(x @ p["w1"].T + p["b1"])
    return comm.reduce_from_group(hidden @ p["w2"].T, tp_group) + p["b2"]


def _rows(x, dp_group):
    d, j = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    m = x.shape[0] // d
    return slice(j * m, (j + 1) * m)


def step_summed(fc1, fc2, x, y, tp_group, dp_group):
    """Sums the gradients over the DP group without dividing by d."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    out = _forward(p, x[rows], tp_group)
    F.mse_loss(out, y[rows]).backward()
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
    return out.detach(), p


def step_no_dp_sync(fc1, fc2, x, y, tp_group, dp_group):
    """Never all-reduces the gradients: each replica keeps its own batch's."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    out = _forward(p, x[rows], tp_group)
    F.mse_loss(out, y[rows]).backward()
    return out.detach(), p


def step_sync_over_tp(fc1, fc2, x, y, tp_group, dp_group):
    """All-reduces the gradients over the TP group, whose ranks hold different shards."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    out = _forward(p, x[rows], tp_group)
    F.mse_loss(out, y[rows]).backward()
    t = dist.get_world_size(tp_group)
    for w in p.values():
        dist.all_reduce(w.grad, group=tp_group)
        w.grad /= t
    return out.detach(), p


def step_whole_batch(fc1, fc2, x, y, tp_group, dp_group):
    """Every DP rank runs the whole batch: no data parallelism at all."""
    p = _shard(fc1, fc2, tp_group)
    out = _forward(p, x, tp_group)
    F.mse_loss(out, y).backward()
    return out.detach(), p


def step_rows_by_tp_rank(fc1, fc2, x, y, tp_group, dp_group):
    """Picks its rows of the batch by its TP rank instead of its DP rank."""
    p = _shard(fc1, fc2, tp_group)
    d, i = dist.get_world_size(dp_group), dist.get_rank(tp_group)
    m = x.shape[0] // d
    rows = slice((i % d) * m, (i % d + 1) * m)
    out = _forward(p, x[rows], tp_group)
    F.mse_loss(out, y[rows]).backward()
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
        w.grad /= d
    return out.detach(), p


def step_bias_before_g(fc1, fc2, x, y, tp_group, dp_group):
    """Adds fc2's bias on every TP rank before g sums the partials."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    hidden = F.gelu(x[rows] @ p["w1"].T + p["b1"])
    out = comm.reduce_from_group(hidden @ p["w2"].T + p["b2"], tp_group)
    F.mse_loss(out, y[rows]).backward()
    d = dist.get_world_size(dp_group)
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
        w.grad /= d
    return out.detach(), p


def step_gathers_hidden(fc1, fc2, x, y, tp_group, dp_group):
    """All-gathers the 4h-wide activation and multiplies with the whole fc2 on every TP rank."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    hidden = comm.gather_from_group(F.gelu(x[rows] @ p["w1"].T + p["b1"]), -1, tp_group)
    w2 = comm.gather_from_group(p["w2"], -1, tp_group)
    out = hidden @ w2.T + p["b2"]
    F.mse_loss(out, y[rows]).backward()
    d = dist.get_world_size(dp_group)
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
        w.grad /= d
    return out.detach(), p


def step_library(fc1, fc2, x, y, tp_group, dp_group):
    """Uses the library's tensor-parallel MLP."""
    from intralayer.tensor_parallel import ParallelMLP
    mlp = ParallelMLP.from_dense(fc1, fc2, tp_group)
    return mlp(x), {}


# ------------------------------------------------------------------ bug hunt: MFU

def _dense():
    return planner.Model("tiny", layers=1, hidden=16, heads=2, kv_heads=2, ffn=64, vocab=1000)


def _moe():
    return planner.Model("tiny MoE", layers=2, hidden=16, heads=2, kv_heads=2, ffn=64, vocab=100, mlp_matrices=3,
                         experts=8, top_k=2, moe_ffn=32)


def test_dense_only(mfu, group):
    """Exact, but on a dense model only: the experts never come into it."""
    model = _dense()
    want = planner.flops_per_token(model, 128)["model"] * 1000.0 / 1e12
    assert abs(mfu(model, 128, 1000.0, 1e12) - want) <= 1e-9 * want


def test_big_model_loose(mfu, group):
    """A big dense model and a 5 % tolerance: the embedding is 1.4 % of Llama 3 70B's FLOPs."""
    model = planner.MODELS["Llama 3 70B"]
    want = planner.flops_per_token(model, 4096)["model"] * 3000.0 / 989e12
    assert abs(mfu(model, 4096, 3000.0, 989e12) - want) <= 0.05 * want


def test_in_range(mfu, group):
    """Only that the MFU is a fraction between 0 and 1."""
    value = mfu(_moe(), 128, 1000.0, 1e12)
    assert 0 < value <= 1


def test_six_n(mfu, group):
    """Its own reference is 6 FLOPs per parameter of every matrix, the embedding's and every expert's included."""
    model = _dense()
    h, V = model.hidden, model.vocab
    layer = 4 * h * h + 2 * h * model.ffn
    want = (6 * (layer + 2 * V * h) + 12 * h * 128) * 1000.0 / 1e12
    assert abs(mfu(model, 128, 1000.0, 1e12) - want) <= 1e-9 * want


def test_by_name(mfu, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert mfu.__name__ == "mfu", "this is not the correct implementation"


def test_a_model_without_either_bug(mfu, group):
    """Compares with the planner on DeepSeek-V3 with a one-word vocabulary and every expert routed, where
    neither bug shows: it caught both only because the buggy versions counted attention unlike the planner
    (the red team's find, fixed by writing them as the planner's count plus the bug)."""
    import dataclasses
    from intralayer import planner
    model = dataclasses.replace(planner.MODELS["DeepSeek-V3"], vocab=1, top_k=256)
    want = planner.flops_per_token(model, 4096)["model"]
    assert abs(mfu(model, 4096, 1.0, 1.0) - want) <= 1e-6 * want


WRONG = [
    ("mesh_ranks_check", place_swapped, ["are strided", "t consecutive ranks"]),
    ("mesh_ranks_check", place_from_zero, ["not in this group", "process numbers"]),
    ("mesh_ranks_check", place_ignores_tp, ["with 2 ranks and t = 1 there are 2 TP groups, of 1 rank each"]),
    ("mesh_ranks_check", place_by_gathering, ["default process group"]),
    ("tp_dp_step_check", step_summed, ["times too large: average over the DP group"]),
    ("tp_dp_step_check", step_no_dp_sync, ["this rank's own batch's gradient", "DP group carried nothing"]),
    ("tp_dp_step_check", step_sync_over_tp, ["the gradient of fc1's weight (w1) is off",
                                             "the DP group carried nothing"]),
    ("tp_dp_step_check", step_whole_batch, ["the output has shape (4, 6); it should have shape (2, 6)"]),
    ("tp_dp_step_check", step_rows_by_tp_rank, ["the output is off", "the gradient of fc2's bias (b2) is off"]),
    ("tp_dp_step_check", step_bias_before_g, ["the output is off", "times fc2's bias: add the bias once, after g"]),
    ("tp_dp_step_check", step_gathers_hidden, ["the TP group carried", "all-gathers"]),
    ("tp_dp_step_check", step_library, ["intralayer.tensor_parallel.ParallelMLP is not allowed here"]),
    ("test_mfu_check", test_dense_only, ["passes on the buggy", "every expert of an MoE layer counted",
                                         "torchtitan#4300"]),
    ("test_mfu_check", test_big_model_loose, ["passes on the buggy", "the embedding's included"]),
    ("test_mfu_check", test_in_range, ["passes on the buggy", "does not catch the bug"]),
    ("test_mfu_check", test_six_n, ["fails on the correct", "must pass on a correct implementation"]),
]


# ------------------------------------------------------------------ new wrong answers (issue 25)

def step_process_number(fc1, fc2, x, y, tp_group, dp_group):
    """Finds its TP and DP ranks from the process number (dist.get_rank()), as on a mesh that starts at 0."""
    t, d = dist.get_world_size(tp_group), dist.get_world_size(dp_group)
    i, j = dist.get_rank() % t, dist.get_rank() // t % d
    f = fc1.out_features // t
    cols = slice(i * f, (i + 1) * f)

    def own(w):
        return w.detach().clone().requires_grad_()

    p = {"w1": own(fc1.weight[cols]), "b1": own(fc1.bias[cols]), "w2": own(fc2.weight[:, cols]), "b2": own(fc2.bias)}
    m = x.shape[0] // d
    rows = slice(j * m, (j + 1) * m)
    out = _forward(p, x[rows], tp_group)
    F.mse_loss(out, y[rows]).backward()
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
        w.grad /= d
    return out.detach(), p


def step_world_group(fc1, fc2, x, y, tp_group, dp_group):
    """All-reduces the gradients in the default group (no group=): every process, not the DP group."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    out = _forward(p, x[rows], tp_group)
    F.mse_loss(out, y[rows]).backward()
    d = dist.get_world_size(dp_group)
    for w in p.values():
        dist.all_reduce(w.grad)
        w.grad /= d
    return out.detach(), p


def step_g_in_dp_group(fc1, fc2, x, y, tp_group, dp_group):
    """Sums the partial outputs (g) over the DP group instead of the TP group."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    hidden = F.gelu(x[rows] @ p["w1"].T + p["b1"])
    out = comm.reduce_from_group(hidden @ p["w2"].T, dp_group) + p["b2"]
    F.mse_loss(out, y[rows]).backward()
    d = dist.get_world_size(dp_group)
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
        w.grad /= d
    return out.detach(), p


def step_averages_in_tp_and_dp(fc1, fc2, x, y, tp_group, dp_group):
    """Averages the gradients over the DP group and then over the TP group too."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    out = _forward(p, x[rows], tp_group)
    F.mse_loss(out, y[rows]).backward()
    d, t = dist.get_world_size(dp_group), dist.get_world_size(tp_group)
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
        w.grad /= d
        dist.all_reduce(w.grad, group=tp_group)
        w.grad /= t
    return out.detach(), p


def step_tanh_gelu(fc1, fc2, x, y, tp_group, dp_group):
    """The right step with the tanh approximation of GeLU."""
    p = _shard(fc1, fc2, tp_group)
    rows = _rows(x, dp_group)
    hidden = F.gelu(x[rows] @ p["w1"].T + p["b1"], approximate="tanh")
    out = comm.reduce_from_group(hidden @ p["w2"].T, tp_group) + p["b2"]
    F.mse_loss(out, y[rows]).backward()
    d = dist.get_world_size(dp_group)
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
        w.grad /= d
    return out.detach(), p


mesh_ranks = place_swapped                  # the learner's part 1, wrong; step_reusing_part1 calls it


def step_reusing_part1(fc1, fc2, x, y, tp_group, dp_group):
    """A right step that finds its DP rank with the learner's own (wrong) mesh_ranks of part 1."""
    p = _shard(fc1, fc2, tp_group)
    dp_ranks = dist.get_process_group_ranks(dp_group)
    _, dps = mesh_ranks(dp_ranks, 1)                                 # the DP group as a 1-wide mesh
    d, j = len(dp_ranks), dps[0].index(dist.get_rank())
    m = x.shape[0] // d
    rows = slice(j * m, (j + 1) * m)
    out = _forward(p, x[rows], tp_group)
    F.mse_loss(out, y[rows]).backward()
    for w in p.values():
        dist.all_reduce(w.grad, group=dp_group)
        w.grad /= d
    return out.detach(), p


def test_throughput_ratio(mfu, group):
    """Only that the MFU doubles with the throughput: true of any count of FLOPs."""
    model = _moe()
    assert abs(mfu(model, 128, 2000.0, 1e12) / mfu(model, 128, 1000.0, 1e12) - 2) <= 1e-12


def test_every_expert_routed(mfu, group):
    """An MoE model whose tokens go to every expert (top_k = experts), and a 5 % tolerance."""
    model = planner.Model("tiny MoE", layers=2, hidden=16, heads=2, kv_heads=2, ffn=64, vocab=100, mlp_matrices=3,
                          experts=4, top_k=4, moe_ffn=32)
    want = planner.flops_per_token(model, 128)["model"] * 1000.0 / 1e12
    assert abs(mfu(model, 128, 1000.0, 1e12) - want) <= 0.05 * want


WRONG += [
    ("tp_dp_step_check", step_process_number, ["it used the global rank (the process number)"]),
    ("tp_dp_step_check", step_world_group, ["used the default process group", "pass group=group"]),
    ("tp_dp_step_check", step_g_in_dp_group, ["the output is off", "the TP group carried"]),
    ("tp_dp_step_check", step_averages_in_tp_and_dp, ["the TP group carried"]),
    ("tp_dp_step_check", step_tanh_gelu, ["tanh approximation of GeLU", "approximate='none'"]),
    ("tp_dp_step_check", step_reusing_part1, ["your mesh_ranks from part 1 fails its check", "are strided"]),
    ("test_mfu_check", test_throughput_ratio, ["passes on the buggy", "does not catch the bug"]),
    ("test_mfu_check", test_every_expert_routed, ["passes on the buggy", "top_k smaller than the number of experts"]),
]



def test_rank0_only(mfu, group):
    """The right test, run on process 0 only: in the pair of processes [1, 2] it checks nothing."""
    if dist.get_rank() != 0:
        return
    dense = planner.Model("tiny", layers=1, hidden=16, heads=2, kv_heads=2, ffn=64, vocab=1000)
    moe = planner.Model("tiny MoE", layers=2, hidden=16, heads=2, kv_heads=2, ffn=64, vocab=100,
                        mlp_matrices=3, experts=8, top_k=2, moe_ffn=32)
    for model in (dense, moe):
        want = planner.flops_per_token(model, 128)["model"] * 1000.0 / 1e12
        assert abs(mfu(model, 128, 1000.0, 1e12) - want) <= 1e-9 * want


WRONG += [("test_mfu_check", test_rank0_only, ["in the group of processes [1, 2]", "assert on one process only"]),
          ("test_mfu_check", test_by_name, ["passes on the buggy", "does not catch the bug"]),
]


WRONG += [("test_mfu_check", test_a_model_without_either_bug, ["passes on the buggy", "does not catch the bug"])]
