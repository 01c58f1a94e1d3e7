"""Wrong answers to lab 02 (Megatron's MLP on real ranks) and its bug hunt (greedy decoding, padded vocabulary)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from intralayer import comm
from intralayer.tensor_parallel import ColumnParallelLinear


def _own(w):
    return w.detach().clone().requires_grad_()


# ------------------------------------------------------------------ shard_mlp

def shard_fc1_by_inputs(fc1, fc2, group):
    """Splits fc1 by its input features (a row split), fc2 by its outputs: the splits swapped."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    h = fc1.in_features // t
    return {"w1": _own(fc1.weight[:, i * h:(i + 1) * h]), "b1": _own(fc1.bias),
            "w2": _own(fc2.weight[i * h:(i + 1) * h]), "b2": _own(fc2.bias[i * h:(i + 1) * h])}


def shard_views(fc1, fc2, group):
    """Returns slices that are views of the dense weights (not leaves, nothing saved)."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    f = fc1.out_features // t
    rows = slice(i * f, (i + 1) * f)
    return {"w1": fc1.weight[rows], "b1": fc1.bias[rows], "w2": fc2.weight[:, rows], "b2": fc2.bias}


def shard_bias_split(fc1, fc2, group):
    """Divides fc2's bias among the ranks."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    f = fc1.out_features // t
    rows = slice(i * f, (i + 1) * f)
    return {"w1": _own(fc1.weight[rows]), "b1": _own(fc1.bias[rows]), "w2": _own(fc2.weight[:, rows]),
            "b2": _own(fc2.bias / t)}


def shard_global_rank(fc1, fc2, group):
    """Picks its slice by the global rank (process number), not the rank in the group."""
    t, i = dist.get_world_size(group), dist.get_rank() % dist.get_world_size(group)
    f = fc1.out_features // t
    rows = slice(i * f, (i + 1) * f)
    return {"w1": _own(fc1.weight[rows]), "b1": _own(fc1.bias[rows]), "w2": _own(fc2.weight[:, rows]),
            "b2": _own(fc2.bias)}


def shard_library(fc1, fc2, group):
    """Builds the library's ParallelMLP and reads its shards."""
    from intralayer.tensor_parallel import ParallelMLP
    mlp = ParallelMLP.from_dense(fc1, fc2, group)
    return {"w1": mlp.fc1.weight, "b1": mlp.fc1.bias, "w2": mlp.fc2.weight, "b2": mlp.fc2.bias}


def shard_library_global(fc1, fc2, group):
    """Uses the library's column-parallel layer, imported at the top of the notebook."""
    layer = ColumnParallelLinear.from_dense(fc1, group)
    return {"w1": layer.weight, "b1": layer.bias, "w2": None, "b2": None}


# ------------------------------------------------------------------ megatron_mlp

def mlp_tanh_gelu(x, p, group):
    """Right f, g and shards, but the tanh approximation of GeLU."""
    x = comm.copy_to_group(x, group)
    h = F.gelu(x @ p["w1"].T + p["b1"], approximate="tanh")             # (s, b, 4h/t)
    return comm.reduce_from_group(h @ p["w2"].T, group) + p["b2"]

def mlp_bias_before_sum(x, p, group):
    x = comm.copy_to_group(x, group)
    hidden = F.gelu(x @ p["w1"].T + p["b1"])
    return comm.reduce_from_group(hidden @ p["w2"].T + p["b2"], group)


def mlp_no_f(x, p, group):
    hidden = F.gelu(x @ p["w1"].T + p["b1"])
    return comm.reduce_from_group(hidden @ p["w2"].T, group) + p["b2"]


def mlp_f_and_g_swapped(x, p, group):
    x = comm.reduce_from_group(x, group) / dist.get_world_size(group)
    hidden = F.gelu(x @ p["w1"].T + p["b1"])
    return comm.copy_to_group(hidden @ p["w2"].T, group) + p["b2"]


def mlp_gathers_hidden(x, p, group):
    """All-gathers the 4h-wide activation and the fc2 shards, then multiplies on every rank."""
    x = comm.copy_to_group(x, group)
    hidden = comm.gather_from_group(F.gelu(x @ p["w1"].T + p["b1"]), -1, group)      # (s, b, 4h)
    w2 = comm.gather_from_group(p["w2"], -1, group)                                  # (h, 4h)
    return hidden @ w2.T + p["b2"]


def mlp_library(x, p, group):
    from intralayer import tensor_parallel
    return tensor_parallel.ParallelMLP(None, None)(x)


# ------------------------------------------------------------------ bug hunt: greedy decoding

def _pieces(t, i, vocab, h=4, seed=0):
    rows = -(-vocab // t)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64)
    hidden = torch.randn(6, h, generator=g, dtype=torch.float64)
    padded = torch.cat([weight, torch.zeros(t * rows - vocab, h, dtype=weight.dtype)])
    return weight, hidden, padded[i * rows:(i + 1) * rows]


def test_divisible_vocab(greedy_token, group):
    """A vocabulary t divides: no padding, so neither bug shows."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    weight, hidden, mine = _pieces(t, i, 12)
    assert torch.equal(greedy_token(hidden, mine, 12, group), (hidden @ weight.T).argmax(-1))


def test_no_negative_row(greedy_token, group):
    """Padding, but random hidden states whose positions each have a positive logit: misses the zero rows."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    vocab = 2 * t + 1
    weight, hidden, mine = _pieces(t, i, vocab)
    hidden = hidden + 10 * weight[0]                          # token 0's logit is large and positive everywhere
    assert torch.equal(greedy_token(hidden, mine, vocab, group), (hidden @ weight.T).argmax(-1))


def test_ids_in_range(greedy_token, group):
    """Catches ids past the vocabulary, not ids that are in range but wrong."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    vocab, rows = 2 * t + 1, -(-(2 * t + 1) // t)
    g = torch.Generator().manual_seed(0)
    weight = torch.rand(vocab, 4, generator=g, dtype=torch.float64) + 0.1     # all positive
    hidden = -torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.1        # so every logit is negative
    padded = torch.cat([weight, torch.zeros(t * rows - vocab, 4, dtype=weight.dtype)])
    ids = greedy_token(hidden, padded[i * rows:(i + 1) * rows], vocab, group)
    assert int(ids.max()) < vocab


def test_process_number(greedy_token, group):
    """The right test, but it cuts this rank's rows of the padded head with the process number."""
    t, i = dist.get_world_size(group), dist.get_rank()
    vocab, rows = 2 * t + 1, -(-(2 * t + 1) // t)
    g = torch.Generator().manual_seed(0)
    weight = torch.rand(vocab, 4, generator=g, dtype=torch.float64) + 0.1
    hidden = -torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.1
    padded = torch.cat([weight, torch.zeros(t * rows - vocab, 4, dtype=weight.dtype)])
    ids = greedy_token(hidden, padded[i * rows:(i + 1) * rows], vocab, group)
    assert torch.equal(ids, (hidden @ weight.T).argmax(-1))


def test_always_passes(greedy_token, group):
    t, i = dist.get_world_size(group), dist.get_rank(group)
    weight, hidden, mine = _pieces(t, i, 2 * t + 1)
    greedy_token(hidden, mine, 2 * t + 1, group)


def test_by_name(greedy_token, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert greedy_token.__name__ == "greedy_token", "this is not the correct implementation"


def test_by_docstring(greedy_token, group):
    """Reads the implementation's docstring, not what it does (the red team's find)."""
    assert "padding rows masked" in (greedy_token.__doc__ or ""), "not the correct implementation"


def test_by_code(greedy_token, group):
    """Reads the names the implementation's code uses, not what it does."""
    assert "masked_fill" in greedy_token.__code__.co_names, "not the correct implementation"


WRONG = [
    ("shard_mlp_check", shard_fc1_by_inputs, ["w1 has shape", "output features"]),
    ("shard_mlp_check", shard_views, ["not a leaf"]),
    ("shard_mlp_check", shard_bias_split, ["b2 is off", "all of fc2.bias"]),
    ("shard_mlp_check", shard_global_rank, ["group rank", "slice", "it used the global rank (the process number)"]),
    ("shard_mlp_check", shard_library, ["intralayer.tensor_parallel.ParallelMLP is not allowed here"]),
    ("shard_mlp_check", shard_library_global, ["uses ColumnParallelLinear", "the library's own Megatron MLP"]),
    ("megatron_mlp_check", mlp_bias_before_sum, ["times fc2's bias", "after the all-reduce"]),
    ("megatron_mlp_check", mlp_no_f, ["x.grad is off", "f's all-reduce in the backward pass",
                                      "sent no all-reduce"]),
    ("megatron_mlp_check", mlp_f_and_g_swapped, ["the output is off"]),
    ("megatron_mlp_check", mlp_gathers_hidden, ["also sent", "all-gather", "never travels"]),
    ("megatron_mlp_check", mlp_library, ["intralayer.tensor_parallel.ParallelMLP is not allowed here"]),
    ("test_greedy_token_check", test_divisible_vocab, ["passes on the buggy", "padding rows"]),
    ("test_greedy_token_check", test_no_negative_row, ["passes on the buggy", "all negative"]),
    ("test_greedy_token_check", test_ids_in_range, ["passes on the buggy", "rank·⌊v/t⌋", "ids below the vocabulary size"]),
    ("test_greedy_token_check", test_process_number, ["fails on the correct", "it used the global rank (the process number)"]),
    ("megatron_mlp_check", mlp_tanh_gelu, ["tanh approximation of GeLU", "approximate='none'"]),
    ("test_greedy_token_check", test_always_passes, ["passes on the buggy", "does not catch the bug"]),
    ("test_greedy_token_check", test_by_name, ["passes on the buggy", "does not catch the bug"]),
]


WRONG += [("test_greedy_token_check", test_by_docstring, ["fails on the correct"]),
          ("test_greedy_token_check", test_by_code, ["fails on the correct"])]


def shard_width_24(fc1, fc2, group):
    """Writes the MLP's width 4h = 24 (h = 6) as a number."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    rows = slice(i * 24 // t, (i + 1) * 24 // t)
    return {"w1": _own(fc1.weight[rows]), "b1": _own(fc1.bias[rows]), "w2": _own(fc2.weight[:, rows]),
            "b2": _own(fc2.bias)}


WRONG += [("shard_mlp_check", shard_width_24, ["h 9:"])]
