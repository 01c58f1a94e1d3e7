"""Wrong answers to lab 01 (Megatron's f and g on real ranks) and its bug hunt (a row-parallel bias)."""
import torch
import torch.distributed as dist


class FIdentityBothWays(torch.autograd.Function):
    """f without its all-reduce: each rank keeps its own gradient."""

    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FSwappedWithG(torch.autograd.Function):
    """g's behaviour under f's name: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FAverages(torch.autograd.Function):
    """f whose backward averages the gradients instead of summing them."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out / dist.get_world_size(ctx.group), None


class FAllReducesTwice(torch.autograd.Function):
    """f that all-reduces in both passes (torch.distributed.nn's all_reduce does)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class GNoSum(torch.autograd.Function):
    """g without its all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GInPlace(torch.autograd.Function):
    """g that all-reduces the caller's tensor in place."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GSumsTheGradientToo(torch.autograd.Function):
    """g that also all-reduces the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class GAllGatherSum(torch.autograd.Function):
    """g from an all-gather of every partial and a local sum: right values, n times the bytes."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return sum(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GStarAtRankZero(torch.autograd.Function):
    """g by sends to 'rank 0', found with dist.get_rank() (the process number), and back."""

    @staticmethod
    def forward(ctx, x, group):
        n = dist.get_world_size(group)
        if dist.get_rank() == 0:
            total = x.clone()
            for q in range(1, n):
                part = torch.empty_like(x)
                dist.recv(part, group=group, group_src=q)
                total += part
            for q in range(1, n):
                dist.send(total, group=group, group_dst=q)
            return total
        dist.send(x.contiguous(), group=group, group_dst=0)
        total = torch.empty_like(x)
        dist.recv(total, group=group, group_src=0)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ------------------------------------------------------------------ bug hunt: a row-parallel bias

def _layer(t):
    torch.manual_seed(0)
    dense = torch.nn.Linear(4 * t, 3, dtype=torch.float64)
    X = torch.randn(5, 4 * t, dtype=torch.float64, requires_grad=True)
    return dense, X


def test_forward_only(row_linear, group):
    """Checks the output and nothing else: misses the bias/t variant."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    dense, X = _layer(t)
    cols = slice(4 * i, 4 * (i + 1))
    y = row_linear(X.detach()[:, cols], dense.weight.detach()[:, cols], dense.bias.detach(), group)
    assert torch.allclose(y, dense(X).detach())


def test_without_bias(row_linear, group):
    """A layer whose bias is zero cannot show a bias bug."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    dense, X = _layer(t)
    cols = slice(4 * i, 4 * (i + 1))
    bias = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    w = dense.weight.detach()[:, cols].clone().requires_grad_()
    y = row_linear(X.detach()[:, cols], w, bias, group)
    y.sum().backward()
    assert torch.allclose(y, X.detach() @ dense.weight.detach().T)


def test_always_fails(row_linear, group):
    t, i = dist.get_world_size(group), dist.get_rank(group)
    dense, X = _layer(t)
    cols = slice(4 * i, 4 * (i + 1))
    y = row_linear(X.detach()[:, cols], dense.weight.detach()[:, cols], dense.bias.detach(), group)
    assert y.shape == (3, 5), f"shape {tuple(y.shape)}"


def test_bias_grad_summed(row_linear, group):
    """Expects the bias gradient summed over ranks: fails on the correct layer."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    dense, X = _layer(t)
    cols = slice(4 * i, 4 * (i + 1))
    bias = dense.bias.detach().clone().requires_grad_()
    y = row_linear(X.detach()[:, cols], dense.weight.detach()[:, cols], bias, group)
    y.sum().backward()
    assert torch.allclose(bias.grad, torch.full((3,), 5.0 * t, dtype=torch.float64))


def test_process_number(row_linear, group):
    """A full test, but it cuts this rank's columns with the process number (dist.get_rank())."""
    t, i = dist.get_world_size(group), dist.get_rank()
    dense, X = _layer(t)
    cols = slice(4 * i, 4 * (i + 1))
    w = dense.weight.detach()[:, cols].clone().requires_grad_()
    bias = dense.bias.detach().clone().requires_grad_()
    y = row_linear(X.detach()[:, cols], w, bias, group)
    y.sum().backward()
    dense(X).sum().backward()
    assert torch.allclose(y, dense(X).detach())
    assert torch.allclose(w.grad, dense.weight.grad[:, cols])
    assert torch.allclose(bias.grad, dense.bias.grad)


def test_by_name(row_linear, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert row_linear.__name__ == "row_linear", "this is not the correct implementation"


class CopyAllReducesInPlace(torch.autograd.Function):
    """f's backward all-reduces the incoming gradient in place, as Megatron's does: right values here, but
    y.sum().backward() hands it an expanded gradient of one number, and gloo then writes past its memory
    (the red team's find: it passed every case)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


WRONG = [
    ("reduce_from_group_check", GAllGatherSum, ["g's forward pass sent 1 all-gather", "one all-reduce"]),
    ("reduce_from_group_check", GStarAtRankZero, ["it used the global rank (the process number)", "dist.get_rank(group)"]),
    ("test_row_linear_check", test_process_number, ["fails on the correct", "it used the global rank (the process number)"]),
    ("copy_to_group_check", FIdentityBothWays, ["x.grad is off", "this rank's own upstream gradient", "sent nothing"]),
    ("copy_to_group_check", FSwappedWithG, ["f's output is off", "f's forward pass sent 1 all-reduce"]),
    ("copy_to_group_check", FAverages, ["the average of the upstream gradients"]),
    ("copy_to_group_check", FAllReducesTwice, ["f's forward pass sent 1 all-reduce", "it should send nothing"]),
    ("reduce_from_group_check", GNoSum, ["g's output is off", "this rank's own partial", "sent nothing"]),
    ("reduce_from_group_check", GInPlace, ["changed its input in place"]),
    ("reduce_from_group_check", GSumsTheGradientToo, ["the sum of the upstream gradients", "g's backward pass sent 1"]),
    ("test_row_linear_check", test_forward_only, ["passes on the buggy", "bias/t", "torchtitan"]),
    ("test_row_linear_check", test_without_bias, ["passes on the buggy", "Hint"]),
    ("test_row_linear_check", test_always_fails, ["fails on the correct", "shape (5, 3)"]),
    ("test_row_linear_check", test_bias_grad_summed, ["fails on the correct"]),
    ("test_row_linear_check", test_by_name, ["passes on the buggy", "does not catch the bug"]),
]


WRONG += [("copy_to_group_check", CopyAllReducesInPlace, ["f's backward wrote into the gradient it was given",
                                                          "Bad address"])]


def test_bias_not_over_t(row_linear, group):
    """The output right and bias.grad not t times too small: passes a bias gradient t times too large."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    dense, X = _layer(t)
    cols = slice(4 * i, 4 * (i + 1))
    bias = dense.bias.detach().clone().requires_grad_()
    y = row_linear(X.detach()[:, cols], dense.weight.detach()[:, cols], bias, group)
    y.sum().backward()
    dense(X).sum().backward()
    assert torch.allclose(y, dense(X).detach())
    assert not torch.allclose(bias.grad, dense.bias.grad / t), "bias gradient divided by t"


def test_output_and_bias_grad_only(row_linear, group):
    """The output and bias.grad against the dense layer, never x.grad or weight.grad."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    dense, X = _layer(t)
    cols = slice(4 * i, 4 * (i + 1))
    bias = dense.bias.detach().clone().requires_grad_()
    y = row_linear(X.detach()[:, cols], dense.weight.detach()[:, cols], bias, group)
    y.sum().backward()
    dense(X).sum().backward()
    assert torch.allclose(y, dense(X).detach())
    assert torch.allclose(bias.grad, dense.bias.grad)


WRONG += [("test_row_linear_check", test_bias_not_over_t, ["passes on the buggy", "bias passes through f"]),
          ("test_row_linear_check", test_output_and_bias_grad_only, ["passes on the buggy",
                                                                     "all-reduces the gradient in the backward"])]


class CopyToGroupFixedShape(torch.autograd.Function):
    """Backward all-reduces into a (3, 5) float64 buffer: right only for the default case's activation."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = torch.zeros(3, 5, dtype=torch.float64)
        out += grad
        dist.all_reduce(out, group=ctx.group)
        return out, None


WRONG += [("copy_to_group_check", CopyToGroupFixedShape, ["shape (2, 4, 6):", "raised RuntimeError"])]


class ReduceFromGroupStraightThrough:
    """g without an autograd function: the all-reduced value, with x's gradient (identity), straight through."""

    @staticmethod
    def apply(x, group):
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return x + (total - x.detach())


class CopyToGroupSetupContext(torch.autograd.Function):
    """f in the setup_context style, its backward's all-reduce asynchronous and waited for."""

    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group, async_op=True).wait()
        return out, None


#: Right answers in forms the checks must accept (a third red team's).
RIGHT = [("reduce_from_group_check", ReduceFromGroupStraightThrough), ("copy_to_group_check", CopyToGroupSetupContext)]
