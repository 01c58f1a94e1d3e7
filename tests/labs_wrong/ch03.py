"""Wrong answers to lab 03 (the sequence-parallel boundary on real ranks) and its bug hunt (LayerNorm gradients)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from intralayer import comm
from intralayer.sequence_parallel import SequenceParallelRowLinear


def _gather(x, group):
    t = dist.get_world_size(group)
    out = x.new_empty((t * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _scatter(y, group):
    t = dist.get_world_size(group)
    out = y.new_empty((y.shape[0] // t, *y.shape[1:]))
    dist.reduce_scatter_single(out, y.contiguous(), group=group)
    return out


# ------------------------------------------------------------------ GatherSequence

class GatherProcessNumber(torch.autograd.Function):
    """All-gather forward; backward sums the gradients, then keeps the rows of the process number mod t."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        t = dist.get_world_size(ctx.group)
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(t)[dist.get_rank() % t].contiguous(), None

class GatherKeepsOwn(torch.autograd.Function):
    """All-gather forward; backward keeps this rank's own rows of its own gradient (a split)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        t, i = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t)[i].contiguous(), None


class GatherAllReduceBackward(torch.autograd.Function):
    """Right gradient, by an all-reduce of the whole gradient and a slice: twice the bytes."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        t, i = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(t)[i].contiguous(), None


class GatherAlongLastDim(torch.autograd.Function):
    """Gathers along the hidden dimension instead of the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, ctx.group), None


class GatherAverages(torch.autograd.Function):
    """Reduce-scatter backward, divided by t: the average of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, ctx.group) / dist.get_world_size(ctx.group), None


class GatherByAllReduce(torch.autograd.Function):
    """An all-gather made of an all-reduce of a zero-padded tensor: t times the bytes of the gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t, i = dist.get_world_size(group), dist.get_rank(group)
        out = x.new_zeros((t * x.shape[0], *x.shape[1:]))
        out[i * x.shape[0]:(i + 1) * x.shape[0]] = x
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, ctx.group), None


class GatherLibrary(torch.autograd.Function):
    """The library's all-gather along the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ------------------------------------------------------------------ sp_mlp

class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, ctx.group), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _scatter(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class _Sum(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, y, group):
        out = y.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGrad(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def mlp_all_reduce_then_slice(x, p, group):
    """Tensor parallelism's all-reduce out of fc2, then this rank's rows: right output, wrong gradients."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    z = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    hidden = F.gelu(_Gather.apply(z, group) @ p["w1"].T + p["b1"])
    y = _Sum.apply(hidden @ p["w2"].T, group).chunk(t)[i]
    return x + y + p["b2"]


def mlp_bias_before_scatter(x, p, group):
    z = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    hidden = F.gelu(_Gather.apply(z, group) @ p["w1"].T + p["b1"])
    return x + _Scatter.apply(hidden @ p["w2"].T + p["b2"], group)


def mlp_syncs_inside(x, p, group):
    """Sums the replicated parameters' gradients inside the layer (Megatron's f on each)."""
    ln_w, ln_b, b2 = (_SumGrad.apply(p[k], group) for k in ("ln_w", "ln_b", "b2"))
    z = F.layer_norm(x, x.shape[-1:], ln_w, ln_b)
    hidden = F.gelu(_Gather.apply(z, group) @ p["w1"].T + p["b1"])
    return x + _Scatter.apply(hidden @ p["w2"].T, group) + b2


def mlp_no_residual(x, p, group):
    z = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    hidden = F.gelu(_Gather.apply(z, group) @ p["w1"].T + p["b1"])
    return _Scatter.apply(hidden @ p["w2"].T, group) + p["b2"]


def mlp_tanh_gelu(x, p, group):
    """The right boundary, but the tanh approximation of GeLU."""
    z = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    hidden = F.gelu(_Gather.apply(z, group) @ p["w1"].T + p["b1"], approximate="tanh")
    return x + _Scatter.apply(hidden @ p["w2"].T, group) + p["b2"]


def mlp_whole_sequence(x, p, group):
    """Returns the whole (s, b, h) output on every rank (an all-reduce out of fc2)."""
    xs = _Gather.apply(x, group)
    z = F.layer_norm(xs, xs.shape[-1:], p["ln_w"], p["ln_b"])
    hidden = F.gelu(z @ p["w1"].T + p["b1"])
    return xs + _Sum.apply(hidden @ p["w2"].T, group) + p["b2"]


def mlp_library(x, p, group):
    fc2 = SequenceParallelRowLinear(4 * x.shape[-1], x.shape[-1], group)
    return fc2(x)


# ------------------------------------------------------------------ sync_grads

def sync_forgets_b2(p, group):
    """Sums the LayerNorm's gradients only; fc2's bias is replicated too."""
    ws = [p["ln_w"], p["ln_b"]]
    flat = torch.cat([w.grad.reshape(-1) for w in ws])
    dist.all_reduce(flat, group=group)
    for w, g in zip(ws, flat.split([w.numel() for w in ws])):
        w.grad.copy_(g.view_as(w.grad))


def sync_averages(p, group):
    """GPT-NeoX's first hook: the average of the shares."""
    ws = [p[k] for k in ("ln_w", "ln_b", "b2")]
    flat = torch.cat([w.grad.reshape(-1) for w in ws])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for w, g in zip(ws, flat.split([w.numel() for w in ws])):
        w.grad.copy_(g.view_as(w.grad))


def sync_everything(p, group):
    """All-reduces every gradient, the shards' too."""
    for w in p.values():
        dist.all_reduce(w.grad, group=group)


def sync_one_call_each(p, group):
    """Right gradients, three all-reduces instead of one."""
    for k in ("ln_w", "ln_b", "b2"):
        dist.all_reduce(p[k].grad, group=group)


def sync_nothing(p, group):
    """Trusts that data parallelism's all-reduce will sum them (it sums over other ranks)."""
    return None


# ------------------------------------------------------------------ bug hunt

def _layer(t, i, h=5):
    s, b, h_out = 4 * t, 2, 3 * t
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(h, dtype=torch.float64)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.normal_()
    W = torch.randn(h_out, h, dtype=torch.float64)
    X = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)
    U = torch.randn(s, b, h_out, dtype=torch.float64)
    rows, cols = slice(i * s // t, (i + 1) * s // t), slice(i * h_out // t, (i + 1) * h_out // t)
    return ln, W, X, U, rows, cols


def _run(sp_norm_linear, group):
    t, i = dist.get_world_size(group), dist.get_rank(group)
    ln, W, X, U, rows, cols = _layer(t, i)
    ((ln(X) @ W.T) * U).sum().backward()
    x = X.detach()[rows].clone().requires_grad_()
    ln_w, ln_b = (w.detach().clone().requires_grad_() for w in (ln.weight, ln.bias))
    weight = W[cols].clone().requires_grad_()
    y = sp_norm_linear(x, ln_w, ln_b, weight, group)
    (y * U[:, :, cols]).sum().backward()
    return ln, W, X, U, rows, cols, x, ln_w, ln_b, weight, y


def test_process_number(sp_norm_linear, group):
    """The full test, but it cuts this rank's tokens and columns with the process number mod t."""
    t, i = dist.get_world_size(group), dist.get_rank() % dist.get_world_size(group)
    ln, W, X, U, rows, cols = _layer(t, i)
    ((ln(X) @ W.T) * U).sum().backward()
    x = X.detach()[rows].clone().requires_grad_()
    ln_w, ln_b = (w.detach().clone().requires_grad_() for w in (ln.weight, ln.bias))
    weight = W[cols].clone().requires_grad_()
    y = sp_norm_linear(x, ln_w, ln_b, weight, group)
    (y * U[:, :, cols]).sum().backward()
    assert torch.allclose(y, (ln(X) @ W.T).detach()[:, :, cols], rtol=1e-12, atol=1e-12)
    assert torch.allclose(ln_w.grad, ln.weight.grad, rtol=1e-12, atol=1e-12)


def test_output_only(sp_norm_linear, group):
    ln, W, X, U, rows, cols, x, ln_w, ln_b, weight, y = _run(sp_norm_linear, group)
    assert torch.allclose(y, (ln(X) @ W.T).detach()[:, :, cols], rtol=1e-12, atol=1e-12)


def test_input_and_weight_grads(sp_norm_linear, group):
    """Checks the gradients of x and of the linear weight, not the LayerNorm's."""
    ln, W, X, U, rows, cols, x, ln_w, ln_b, weight, y = _run(sp_norm_linear, group)
    assert torch.allclose(x.grad, X.grad[rows], rtol=1e-12, atol=1e-12)
    assert torch.allclose(y, (ln(X) @ W.T).detach()[:, :, cols], rtol=1e-12, atol=1e-12)


def test_ln_grads_of_own_tokens(sp_norm_linear, group):
    """Expects each rank's LayerNorm gradient to be its own tokens' share: fails on the correct layer."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    ln, W, X, U, rows, cols = _layer(t, i)
    mine = torch.zeros_like(U)
    mine[rows] = U[rows]
    ((ln(X) @ W.T) * mine).sum().backward()
    x = X.detach()[rows].clone().requires_grad_()
    ln_w, ln_b = (w.detach().clone().requires_grad_() for w in (ln.weight, ln.bias))
    weight = W[cols].clone().requires_grad_()
    y = sp_norm_linear(x, ln_w, ln_b, weight, group)
    (y * U[:, :, cols]).sum().backward()
    assert torch.allclose(ln_w.grad, ln.weight.grad, rtol=1e-12, atol=1e-12)


def test_ln_grads_agree_across_ranks(sp_norm_linear, group):
    """Checks that every rank holds the same LayerNorm gradient: an average agrees too."""
    ln, W, X, U, rows, cols, x, ln_w, ln_b, weight, y = _run(sp_norm_linear, group)
    every = [torch.empty_like(ln_w.grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, ln_w.grad, group=group)
    assert all(torch.allclose(e, ln_w.grad, rtol=1e-12, atol=1e-12) for e in every)


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _scatter(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


GatherSequence = GatherKeepsOwn                # the learner's part 1, wrong; mlp_reusing_part1 uses it


def mlp_reusing_part1(x, p, group):
    """A right sp_mlp on top of a wrong GatherSequence of part 1 (its backward keeps its own rows)."""
    z = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    hidden = F.gelu(GatherSequence.apply(z, group) @ p["w1"].T + p["b1"])
    return x + _ScatterSequence.apply(hidden @ p["w2"].T, group) + p["b2"]


def test_by_name(sp_norm_linear, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert sp_norm_linear.__name__ == "sp_norm_linear", "this is not the correct implementation"


class GatherByTorch:
    """torch's differentiable all-gather (its backward reduce-scatters), which is this part's answer."""

    @staticmethod
    def apply(x, group):
        import torch.distributed.nn.functional as dnnf
        return torch.cat(dnnf.all_gather(x.contiguous(), group=group), dim=0)


def test_not_own_share(sp_norm_linear, group):
    """Asks only that ln_w.grad and ln_b.grad are no longer this rank's own tokens' share (the red team's weak
    test: it caught both bugs the graders used, and would pass a gradient summed twice, or any garbage)."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    s, b, h, out = 4 * t, 2, 5, 3 * t
    g = torch.Generator().manual_seed(0)
    ln_w0, ln_b0 = torch.rand(h, generator=g, dtype=torch.float64) + 0.5, torch.randn(h, generator=g, dtype=torch.float64)
    W, X = torch.randn(out, h, generator=g, dtype=torch.float64), torch.randn(s, b, h, generator=g, dtype=torch.float64)
    x = X[i * s // t:(i + 1) * s // t].clone()
    ln_w, ln_b = ln_w0.clone().requires_grad_(), ln_b0.clone().requires_grad_()
    sp_norm_linear(x, ln_w, ln_b, W[i * out // t:(i + 1) * out // t].clone(), group).sum().backward()
    own_w, own_b = ln_w0.clone().requires_grad_(), ln_b0.clone().requires_grad_()
    (F.layer_norm(x, (h,), own_w, own_b) @ W.T).sum().backward()
    assert not torch.allclose(ln_w.grad, own_w.grad), "ln_w.grad was not summed"
    assert not torch.allclose(ln_b.grad, own_b.grad), "ln_b.grad was not summed"


WRONG = [
    ("gather_sequence_check", GatherProcessNumber, ["x.grad is off", "it used the global rank (the process number)"]),
    ("sp_mlp_check", mlp_tanh_gelu, ["the output is off", "tanh approximation of GeLU", "approximate='none'"]),
    ("sp_mlp_check", mlp_reusing_part1, ["your GatherSequence from part 1 fails its check", "x.grad is off"]),
    ("test_sp_norm_linear_check", test_process_number, ["fails on the correct", "it used the global rank (the process number)"]),
    ("gather_sequence_check", GatherKeepsOwn, ["x.grad is off", "own gradient of its rows only",
                                               "sums the", "sent nothing"]),
    ("gather_sequence_check", GatherAllReduceBackward, ["backward pass sent 1 all-reduce", "twice the bytes"]),
    ("gather_sequence_check", GatherAlongLastDim, ["has shape", "gather along dim 0, the sequence"]),
    ("gather_sequence_check", GatherAverages, ["x.grad is off", "the average", "times too small"]),
    ("gather_sequence_check", GatherByAllReduce, ["forward pass sent 1 all-reduce", "one all-gather"]),
    ("gather_sequence_check", GatherLibrary, ["uses comm", "the library's own all-gather along the sequence"]),
    ("sp_mlp_check", mlp_all_reduce_then_slice, ["also sent 1 all-reduce", "it becomes a reduce-scatter",
                                                 "gradient of fc2's weight (w2) is off"]),
    ("sp_mlp_check", mlp_bias_before_scatter, ["times fc2's bias", "after the reduce-scatter"]),
    ("sp_mlp_check", mlp_syncs_inside, ["already summed over the", "to sync_grads",
                                        "also sent 3 all-reduces (6 elements each)\n"]),
    ("sp_mlp_check", mlp_no_residual, ["the residual x is missing"]),
    ("sp_mlp_check", mlp_whole_sequence, ["(the whole sequence)", "only this rank's s/t tokens"]),
    ("sp_mlp_check", mlp_library, ["uses SequenceParallelRowLinear", "sequence-parallel layers"]),
    ("sync_grads_check", sync_forgets_b2, ["fc2's bias (b2) is off", "still this rank's share",
                                           "it should sum the 18 elements"]),
    ("sync_grads_check", sync_averages, ["the average of the shares", "times too small"]),
    ("sync_grads_check", sync_everything, ["w1 is this rank's own shard", "sum only the replicated"]),
    ("sync_grads_check", sync_one_call_each, ["sent 3 all-reduces", "flattened into one tensor"]),
    ("sync_grads_check", sync_nothing, ["still this rank's share", "sent nothing"]),
    ("test_sp_norm_linear_check", test_output_only, ["passes on the buggy", "does not catch the bug",
                                                     "ln_w.grad and ln_b.grad"]),
    ("test_sp_norm_linear_check", test_input_and_weight_grads, ["passes on the buggy", "gpt-neox#1259"]),
    ("test_sp_norm_linear_check", test_ln_grads_of_own_tokens, ["fails on the correct",
                                                                "must pass on a correct implementation"]),
    ("test_sp_norm_linear_check", test_ln_grads_agree_across_ranks, ["passes on the buggy",
                                                                     "gradients averaged over the group"]),
    ("test_sp_norm_linear_check", test_by_name, ["passes on the buggy", "does not catch the bug"]),
]


WRONG += [("gather_sequence_check", GatherByTorch, ["torch.distributed.nn.functional.all_gather is not allowed here"])]


WRONG += [("test_sp_norm_linear_check", test_not_own_share, ["passes on the buggy", "summed over the group twice"])]


def test_ln_weight_only(sp_norm_linear, group):
    """Compares ln_w.grad with the dense LayerNorm's and nothing else."""
    ln, W, X, U, rows, cols, x, ln_w, ln_b, weight, y = _run(sp_norm_linear, group)
    assert torch.allclose(ln_w.grad, ln.weight.grad, rtol=1e-12, atol=1e-12)


WRONG += [("test_sp_norm_linear_check", test_ln_weight_only, ["passes on the buggy", "but not ln_b's"])]


def sync_grads_width_6(p, group):
    """Writes h = 6 as a number: split([6, 6, 6])."""
    flat = torch.cat([p["ln_w"].grad, p["ln_b"].grad, p["b2"].grad])
    dist.all_reduce(flat, group=group)
    p["ln_w"].grad, p["ln_b"].grad, p["b2"].grad = flat.split([6, 6, 6])


WRONG += [("sync_grads_check", sync_grads_width_6, ["h 9:"])]


def sync_grads_flatten_utils(p, group):
    """torch's own flatten and unflatten helpers, each .grad replaced rather than copied into."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    ws = [p["ln_w"], p["ln_b"], p["b2"]]
    flat = _flatten_dense_tensors([w.grad for w in ws])
    dist.all_reduce(flat, group=group)
    for w, g in zip(ws, _unflatten_dense_tensors(flat, [w.grad for w in ws])):
        w.grad = g


#: Right answers in forms the checks must accept (a third red team's).
RIGHT = [("sync_grads_check", sync_grads_flatten_utils)]
