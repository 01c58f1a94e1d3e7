"""Chapter 06's lab and bug hunt: expert parallelism's two all-to-alls; the experts' gradient under data parallelism.

Lab (``solutions/labs/06_expert_parallel.ipynb``): E experts on the P ranks of the group,
E/P per rank, contiguously (rank r owns experts r·E/P … (r+1)·E/P − 1); every rank routes
its own tokens (here the check hands over the router's choices and weights, dropless).

- ``ep_dispatch(x, expert_index, experts, group)``: send every assignment's token row to
  the rank of its expert. This rank's assignments are sorted by expert, then by token;
  the per-expert counts, (P, E/P), go first in one small all-to-all, so every rank learns
  how many rows to expect from whom; then the rows go in one ``all_to_all_single`` with
  uneven splits. Returns ``(received, per_expert)``: the rows this rank's experts must
  process, by source rank, then local expert, then token, and the (P sources, E/P) counts
  received. Backward sends each row's gradient home (the reverse all-to-all).
- ``ep_moe(x, expert_index, weights, w1, w3, w2, group)``: the whole layer on this rank's
  tokens: dispatch, each local SwiGLU expert on its rows from every source, and the
  combine — the outputs sent home by the reverse all-to-all, weighted and added to their
  tokens. Compared with the single-device layer (a per-token loop over all the group's
  tokens with the dense experts): the output, and the gradients of x, of the combine
  weights and of this rank's experts (which sum the contributions of every rank's tokens).

The checks count the all-to-alls and their sizes S (one rank's send buffer, as
nccl-tests defines it): forward the E counts, A·h for the dispatch (A = T·k assignments)
and R·h for the combine (R rows received); backward the two row exchanges reversed, and
nothing else: no all-gather of the tokens, no all-reduce. The library's own
expert-parallel layer and its autograd all-to-all (:mod:`intralayer.expert_parallel`,
:mod:`intralayer.comm`) are refused while the learner's code runs.

Bug hunt: data parallelism averages the replicated router's gradient over the ranks (an
all-reduce, then 1/P), but an expert's gradient already sums over every rank's tokens —
they came to it through the all-to-all — so it needs the 1/P and no all-reduce. The bug:
the experts' gradient left P times too large (fixed in MegaBlocks, databricks/megablocks#20,
in DeepSpeed's expert-parallel gradient scaling, deepspeedai/DeepSpeed#5259, and in
Megatron-FSDP v2, NVIDIA/Megatron-LM#5956). The layer under test uses Megatron-Core's other
dispatcher, all-gather in and reduce-scatter out, so that it gives away none of the lab's
all-to-all code. The hidden variant leaves the router's gradient on each rank as its own
tokens made it, not all-reduced — the kind of bug reported for the router under tensor
and sequence parallelism (NVIDIA/Megatron-LM#599, pytorch/torchtitan#2387).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from .parts import Implementation, Param, hunt, lab
from .common import calls_of, differ, earlier_part, group_info, traffic
from .runner import Mode, watch

H_, F_ = 4, 5                          # hidden size, expert width; E = m·P experts, m per rank (2 or 3)
#: float64: the longest reduction is an F_ = 5-term row of a down projection, or a weight
#: gradient's sum over the group's ≤ 4·7·2 = 56 assignments; 2γ_n·Σ|terms| with n ≤ 60 and
#: Σ|terms| ≲ 100 is ≈ 1e-12, so 1e-10 is a wide margin far below a wrong answer's error.
TOL = dict(rtol=1e-10, atol=1e-10)
PARAMS = {"seed": Param(0, minimum=0), "k": Param(2, (1, 2)), "empty": Param(False, (False, True)),
          "per_rank": Param(2, (2, 3))}
WHY = ("intralayer.expert_parallel is the library's own expert-parallel layer, intralayer.comm its autograd "
       "all-to-all and intralayer.moe its sort by expert, and torch.distributed.nn.functional and "
       "torch.distributed._functional_collectives hold torch's own differentiable all-to-all: the answers to this "
       "lab; write them with torch.distributed's all_to_all_single and a torch.autograd.Function")
FORBID = ("intralayer.expert_parallel", "intralayer.moe", "intralayer.comm", "torch.distributed.nn.functional",
          "torch.distributed._functional_collectives")


def tokens_of(me: int, n: int, empty: bool) -> int:
    """Group rank ``me``'s number of tokens: 11, 12, 13, 14 — or none for the last rank of an ``empty`` case.
    Enough that a rank has over 20 assignments (k = 2): torch's sort without stable=True then reorders the
    tokens of one expert, and a learner's unstable sort shows."""
    return 0 if empty and me == n - 1 else 11 + me


def _exact(whole: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``whole`` plus a fraction of 2⁻⁴⁰ steps, in float64: sums of a few stay exact in float64 (under 53 bits), and
    a row that travels in a narrower dtype (float32 keeps 24 bits, an integer none) loses its fraction."""
    return whole.to(torch.float64) + torch.randint(1, 2 ** 20, whole.shape, generator=g).to(torch.float64) * 2.0 ** -40


def _narrowed(got, want: torch.Tensor, what: str) -> str | None:
    """Words for ``got`` that is ``want`` rounded to a narrower dtype (the rows sent as float32, say), else None."""
    if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.is_floating_point()):
        return None
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        if torch.equal(got.detach().to(torch.float64), want.to(dtype).to(torch.float64)):
            return (f"{what} holds the right numbers rounded to {str(dtype).removeprefix('torch.')}: they travelled in "
                    f"a narrower dtype than the tokens' {str(want.dtype).removeprefix('torch.')}; send and receive "
                    "in the tokens' own dtype (torch.empty(..., dtype=x.dtype), or new_empty)")
    return None


def routing(case: dict, n: int, q: int, integer: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group rank q's tokens (T, h), the router's choices (T, k) and combine weights (T, k); every rank can
    make every rank's. The last expert is the most popular (uneven splits). On 3 or more ranks, expert 1
    is never chosen (an expert with no rows) and group rank 0 never picks the last expert; on 2 ranks
    every expert gets rows from every source, so that rows grouped by expert instead of by source
    (or in any other wrong order) differ on every rank."""
    E = case["per_rank"] * n
    g = torch.Generator().manual_seed(1000 * case["seed"] + 10 * n + q)
    T, k = tokens_of(q, n, case["empty"]), case["k"]
    x = (_exact(torch.randint(-6, 7, (T, H_), generator=g), g) if integer
         else torch.randn(T, H_, generator=g, dtype=torch.float64))
    popularity = torch.ones(E, dtype=torch.float64)
    popularity[-1] = 3.0
    if n >= 3:
        popularity[1] = 0.0
        if q == 0:
            popularity[-1] = 0.0
    expert_index = torch.multinomial(popularity.expand(T, E), k, replacement=False, generator=g) if T else \
        torch.zeros(0, k, dtype=torch.int64)
    weights = torch.softmax(torch.randn(T, k, generator=g, dtype=torch.float64), dim=-1)
    return x, expert_index, weights


def by_expert(expert_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's assignments as (token, expert), sorted by expert, then token."""
    T, k = expert_index.shape
    token = torch.arange(T).repeat_interleave(k)
    expert = expert_index.reshape(-1)
    order = torch.argsort(expert * max(T, 1) + token)
    return token[order], expert[order]


def expected(xs: list[torch.Tensor], choices: list[torch.Tensor], q: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows rank q receives and its (P, E/P) counts (m = E/P), worked out from every rank's data (no
    communication)."""
    P = len(xs)
    rows, counts = [], torch.zeros(P, m, dtype=torch.int64)
    for s in range(P):
        token, expert = by_expert(choices[s])
        mine = expert // m == q
        rows.append(xs[s][token[mine]])
        counts[s] = torch.bincount(expert[mine] - m * q, minlength=m)
    return torch.cat(rows), counts


def _row_words(got: torch.Tensor, want: torch.Tensor, counts: torch.Tensor, xs) -> str:
    """Where the received rows first go wrong: which source, which expert, which token."""
    bad = int(torch.nonzero((got.detach() != want).any(-1))[0])
    starts = torch.cumsum(counts.flatten(), 0)
    s, e = divmod(int(torch.searchsorted(starts, torch.tensor(bad), right=True)), counts.shape[1])

    def whose(row, ranks) -> str | None:
        return next((f"rank {q}'s token {t}" for q in ranks for t in range(xs[q].shape[0])
                     if torch.equal(row, xs[q][t])), None)

    held = whose(got.detach()[bad], range(len(xs))) or "no token of any rank"
    return (f"received row {bad} holds {held}; it should hold {whose(want[bad], [s])}, for this rank's local expert "
            f"{e} (rows come by source rank, then local expert, then token)")


def _alltoalls(calls, want: list[tuple[int, str]], what: str) -> list[str]:
    """Problems unless ``calls`` are exactly all-to-alls of the wanted sizes (in elements), each (size, what it is)."""
    a2a = calls_of(calls, "all_to_all")
    others = [c for c in calls if c.op != "all_to_all"]
    problems = []
    if others:
        problems.append(f"{what} also sent {traffic(others)}: expert parallelism moves each row once, to the rank "
                        "of its expert and back, with all-to-all")
    if sorted(c.elements for c in a2a) != sorted(size for size, _ in want):
        need = "; ".join(words for _, words in want)
        problems.append(f"{what} sent {traffic(a2a) if a2a else 'no all-to-all'}; it should send "
                        f"{len(want)} all-to-all{'s' if len(want) > 1 else ''}: {need}")
    return problems


def everyone(ok: bool, group) -> bool:
    """Whether ``ok`` holds on every rank of the group. The backward pass has collectives: every rank
    runs it or none does, or the ranks that do would wait for the others until the group's timeout."""
    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _summary_dispatch(facts: dict) -> str:
    return (f"{facts['n']} ranks, E = {facts['E']} experts (group rank 0: T = {facts['T']}, A = {facts['A']} "
            f"assignments): the counts first ({facts['E']} numbers), then the rows, S = A·h·e = {facts['S']} bytes "
            f"({facts['away']} of them to other ranks), {facts['R']} rows received; backward one all-to-all of "
            f"R·h = {facts['R'] * H_} numbers")


@lab("ep_dispatch", ("ep_dispatch",), params=PARAMS, forbid_modules=FORBID, why=WHY, summary=_summary_dispatch)
def check_dispatch(ns, case, group) -> dict:
    n, me = group_info(group)
    m = case["per_rank"]
    E = m * n
    data = [routing(case, n, q, integer=True) for q in range(n)]
    xs, choices = [d[0] for d in data], [d[1] for d in data]
    x0, expert_index = xs[me], choices[me]
    A = expert_index.numel()
    want_rows, want_counts = expected(xs, choices, me, m)
    R = want_rows.shape[0]
    x = x0.clone().requires_grad_()
    with watch() as forward:
        out = ns.ep_dispatch(x, expert_index.clone(), E, group)
    problems = []
    if not (isinstance(out, tuple) and len(out) == 2):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        return {"problems": [f"ep_dispatch returned {got}; it should return (received, per_expert)"], "facts": {}}
    received, per_expert = out
    wrong = differ(per_expert, want_counts, "per_expert")
    if wrong and isinstance(per_expert, torch.Tensor) and per_expert.shape == want_counts.shape \
            and torch.equal(per_expert.to(torch.int64), want_counts):
        wrong = None                                        # any integer dtype will do
    if wrong:
        if isinstance(per_expert, torch.Tensor) and per_expert.shape == want_counts.shape \
                and torch.equal(per_expert.to(torch.int64), want_counts.T.reshape(n, m)):
            wrong += "; it is transposed: per_expert[s, e] counts the rows from rank s for local expert e"
        elif isinstance(per_expert, torch.Tensor) and per_expert.shape != want_counts.shape:
            wrong += " (P source ranks, E/P local experts)"
        problems.append(wrong)
    wrong = differ(received, want_rows, "received")
    if wrong and _narrowed(received, want_rows, "received"):
        wrong = _narrowed(received, want_rows, "received")
    elif wrong and isinstance(received, torch.Tensor) and received.shape == want_rows.shape \
            and received.dtype == want_rows.dtype:
        wrong = _row_words(received, want_rows, want_counts, xs)
    elif wrong and isinstance(received, torch.Tensor) and received.dim() == 2 and received.shape[1] == H_:
        wrong += f": this rank's experts get R = {R} rows from the group"
    problems += [wrong] if wrong else []
    problems += _alltoalls(forward, [(E, f"the per-expert counts ((P, E/P) = {E} numbers)"),
                                     (A * H_, f"the rows (A·h = {A}·{H_} = {A * H_} numbers, one row per "
                                              "assignment)")], "the forward pass")
    a2a = calls_of(forward, "all_to_all")
    if len(a2a) == 2 and a2a[0].elements != E and a2a[1].elements == E:
        problems.append("the counts went after the rows: exchange the counts first, so that every rank knows the "
                        "receive splits of the rows' all-to-all")
    ready = isinstance(received, torch.Tensor) and received.shape == want_rows.shape and received.requires_grad
    if not wrong and not received.requires_grad:
        problems.append("received does not require a gradient: dist.all_to_all_single is not differentiable; "
                        "wrap it in a torch.autograd.Function whose backward sends the gradient back")
    if everyone(ready, group):                        # (a rank whose rows are wrong still takes part)
        grads = [_exact(torch.randint(-3, 4, (expected(xs, choices, q, m)[0].shape[0], H_), generator=g), g)
                 for q in range(n) for g in [torch.Generator().manual_seed(50 + q)]]
        with watch() as backward:
            (received * grads[me]).sum().backward()
        want_grad = torch.zeros_like(x0)
        token, expert = by_expert(expert_index)
        for q in range(n):                            # the block of rank q's received rows that came from here
            counts_q = expected(xs, choices, q, m)[1]
            start = int(counts_q[:me].sum())
            block = grads[q][start:start + int(counts_q[me].sum())]
            want_grad.index_add_(0, token[expert // m == q], block)
        grad_wrong = differ(x.grad, want_grad, "x.grad")
        if not wrong and grad_wrong:
            problems.append(_narrowed(x.grad, want_grad, "x.grad") or grad_wrong + "; each token's gradient is the "
                            "sum of the gradients its rows got on the ranks they went to, sent back by the reverse "
                            "all-to-all")
        if not wrong:
            problems += _alltoalls(backward, [(R * H_, f"the received rows' gradient, sent home (R·h = {R}·{H_} "
                                                       "numbers)")], "the backward pass")
    token, expert = by_expert(expert_index)
    away = int((expert // m != me).sum())
    return {"problems": problems, "facts": {"n": n, "E": E, "T": x0.shape[0], "A": A, "R": R,
                                            "S": A * H_ * x0.element_size(), "away": away * H_ * x0.element_size()}}


# ---------------------------------------------------------------------------- the whole layer

def dense_experts(seed: int, E: int) -> dict[str, torch.Tensor]:
    """The E SwiGLU experts, float64, the same on every rank."""
    g = torch.Generator().manual_seed(7 + seed)
    return {"w1": torch.randn(E, F_, H_, generator=g, dtype=torch.float64) / H_ ** 0.5,
            "w3": torch.randn(E, F_, H_, generator=g, dtype=torch.float64) / H_ ** 0.5,
            "w2": torch.randn(E, H_, F_, generator=g, dtype=torch.float64) / F_ ** 0.5}


class _ExpertRows(Mode):
    """The rows the learner's code multiplied by each local expert's matrices, per matrix, found in torch's matrix
    products by storage: one expert's matrix ``w1[e]`` (or its transpose), or the whole ``(E/P, ·, ·)`` stack in a
    batched product (each expert then counts the batch's rows)."""

    _PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}

    def __init__(self, local: dict):
        super().__init__()
        self.local = {w.untyped_storage().data_ptr(): (name, w) for name, w in local.items()}
        self.rows = {(name, e): 0 for name, w in local.items() for e in range(w.shape[0])}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self._PRODUCTS:
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2][-2:]
            for mine, other in ((mats[:1] + mats[1:2]), (mats[1:2] + mats[:1])) if len(mats) == 2 else ():
                name, w = self.local.get(mine.untyped_storage().data_ptr(), (None, None))
                if name is None:
                    continue
                each = w[0].numel()
                if mine.numel() == each:                           # one expert's matrix
                    e = (mine.storage_offset() - w.storage_offset()) // each
                    self.rows[(name, e)] += other.numel() // w.shape[-1]   # (out, in): rows of in numbers
                elif mine.numel() == w.numel() and other.dim() == 3:   # every expert at once
                    for e in range(w.shape[0]):
                        self.rows[(name, e)] += other.shape[-2] if other.shape[-1] == w.shape[-1] else other.shape[-1]
                break
        return func(*args, **(kwargs or {}))


def _expert_work(rows: dict, counts: torch.Tensor) -> str | None:
    """Words if some local expert's matrix met more rows than the most any local expert was routed (padding every
    expert to that many is fine; every expert on every received row is not)."""
    most = int(counts.sum(0).max()) if counts.numel() else 0
    over = [(e, name, r) for (name, e), r in rows.items() if r > most]
    if not over:
        return None
    e, name, r = max(over, key=lambda o: o[2])
    return (f"it multiplied {r} rows by local expert {e}'s {name}, but {int(counts[:, e].sum())} rows were routed to "
            f"that expert (and at most {most} to any): run each expert on its own rows only — an expert layer's "
            "compute grows with the tokens routed, not with the experts")


def swiglu(w: dict, e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert e on rows (m, h): w2 · (silu(w1 x) ⊙ w3 x)."""
    return (F.silu(rows @ w["w1"][e].T) * (rows @ w["w3"][e].T)) @ w["w2"][e].T


def single_device(x, expert_index, weights, w) -> torch.Tensor:
    """The reference: one token and one of its experts at a time, every expert on one device."""
    T, k = expert_index.shape
    rows = []
    for t in range(T):
        y = torch.zeros_like(x[t])
        for j in range(k):
            y = y + weights[t, j] * swiglu(w, int(expert_index[t, j]), x[t:t + 1])[0]
        rows.append(y)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


def _gradients(x, weights, local: dict, leaves, ref: dict, mine: slice, n: int) -> list[str]:
    """Problems with the gradients of x, the combine weights and this rank's experts, against the reference."""
    def grad_of(t):
        return t.grad if t.grad is not None else torch.zeros_like(t)

    checks = [("x.grad", x.grad, grad_of(leaves[0]), "it comes back through the dispatch's reverse all-to-all"),
              ("the gradient of the weights", weights.grad, grad_of(leaves[2]),
               "each weight's gradient is ⟨its expert's output row, the token's upstream gradient⟩")]
    for name in ("w1", "w3", "w2"):
        checks.append((f"the gradient of this rank's {name}", local[name].grad, ref[name].grad[mine],
                       "a local expert's gradient sums over the rows it received from every rank"))
    problems = []
    for label, got, want, why in checks:
        if got is None and want.numel() == 0:
            continue                                    # a rank without tokens
        wrong = differ(got, want, label, **TOL)
        if wrong:
            if isinstance(got, torch.Tensor) and got.shape == want.shape and want.abs().max() > 0 and \
                    torch.allclose(got, n * want, **TOL):
                wrong += f"; it is {n} times too large"
            problems.append(wrong + f"; {why}")
    return problems


def _summary_moe(facts: dict) -> str:
    return (f"{facts['n']} ranks, E = {facts['E']} experts, {facts['E'] // facts['n']} per rank: output and the "
            f"gradients of x, the weights and every local expert equal the single-device layer's; group rank 0 sent "
            f"the counts, the dispatch (S = {facts['dispatch']} bytes) and the combine (S = {facts['combine']} bytes), "
            "and the two back in the backward pass")


@lab("ep_moe", ("ep_moe",), params=PARAMS, forbid_modules=FORBID, why=WHY, summary=_summary_moe)
def check_moe(ns, case, group) -> dict:
    n, me = group_info(group)
    earlier = earlier_part(ns, "ep_dispatch", 1, check_dispatch, case, group)
    m = case["per_rank"]
    E = m * n
    data = [routing(case, n, q, integer=False) for q in range(n)]
    dense = dense_experts(case["seed"], E)
    uprs = [torch.randn(d[0].shape, generator=torch.Generator().manual_seed(60 + q), dtype=torch.float64)
            for q, d in enumerate(data)]
    # the single-device layer on every rank's tokens; every rank's loss is its tokens' ⟨y, upstream⟩
    ref = {name: v.clone().requires_grad_() for name, v in dense.items()}
    leaves = [(x.clone().requires_grad_(), idx, w.clone().requires_grad_()) for x, idx, w in data]
    wants = [single_device(x, idx, w, ref) for x, idx, w in leaves]
    sum((y * u).sum() for y, u in zip(wants, uprs)).backward()
    x0, expert_index, w0 = data[me]
    x, weights = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    mine = slice(m * me, m * me + m)
    local = {name: v[mine].clone().requires_grad_() for name, v in dense.items()}
    A = expert_index.numel()
    _, counts = expected([d[0] for d in data], [d[1] for d in data], me, m)
    R = int(counts.sum())
    with watch() as forward, _ExpertRows(local) as work:
        y = ns.ep_moe(x, expert_index.clone(), weights, local["w1"], local["w3"], local["w2"], group)
    problems = []
    wrong = differ(y, wants[me].detach(), "the output", **TOL)
    if wrong and isinstance(y, torch.Tensor) and y.shape == x0.shape:
        t = int(torch.nonzero(((y.detach() - wants[me].detach()).abs() > 1e-8).any(-1))[0])
        where = ", ".join(f"expert {int(e)} on rank {int(e) // m}" for e in expert_index[t])
        wrong += f"; token {t}'s row is wrong (its experts: {where})"
        unweighted = single_device(x0, expert_index, torch.ones_like(w0), dense)
        if torch.allclose(y.detach(), unweighted, **TOL):
            wrong += ": every row is the unweighted sum of its experts' outputs; multiply by the weights"
    problems += [wrong] if wrong else []
    problems += [words] if (words := _expert_work(work.rows, counts)) else []
    problems += _alltoalls(forward, [(E, f"the per-expert counts ({E} numbers)"),
                                     (A * H_, f"the dispatch (A·h = {A}·{H_} numbers)"),
                                     (R * H_, f"the combine (R·h = {R}·{H_} numbers: the outputs of the rows this "
                                              "rank's experts received)")], "the forward pass")
    ready = isinstance(y, torch.Tensor) and y.shape == x0.shape and y.requires_grad
    if not wrong and not y.requires_grad:
        problems.append("the output does not require a gradient: both all-to-alls must be differentiable")
    if everyone(ready, group):                        # (a rank whose output is wrong still takes part)
        with watch() as backward:
            (y * uprs[me]).sum().backward()
        if not wrong:
            problems += _alltoalls(backward, [
                (A * H_, f"the combine's backward, the gradient of the A = {A} returned rows sent to the experts' "
                         "ranks"),
                (R * H_, f"the dispatch's backward, the gradient of the R = {R} received rows sent home")],
                "the backward pass")
            problems += _gradients(x, weights, local, leaves[me], ref, mine, n)
    e = x0.element_size()
    if earlier:                              # what the rest found would only repeat it
        return {"problems": earlier, "facts": {}}
    return {"problems": problems, "facts": {"n": n, "E": E, "dispatch": A * H_ * e, "combine": R * H_ * e}}


# ---------------------------------------------------------------------------- bug hunt: the experts' gradient

def _local_gradients(x, router, w, group):
    """One step of a top-1 MoE layer of linear experts, this rank's experts w (E/P, h, h), dispatched by
    all-gather and combined by reduce-scatter; the loss is the mean over this rank's tokens of ½‖y‖².
    Returns this rank's gradients of the router and of its experts, before any synchronization."""
    r, n = dist.get_rank(group), w.shape[0]
    p, e = torch.softmax(x @ router.T, dim=-1).max(dim=-1)       # (T,): top-1 probability and expert
    xs = comm.all_gather(x * p[:, None], 0, group)               # (P·T, h): every rank's scored tokens
    es = comm.all_gather(e.to(x.dtype), 0, group).long()         # (P·T,): their experts
    out = torch.zeros_like(xs)
    for j in range(n):
        rows = torch.nonzero(es == r * n + j).squeeze(1)         # the tokens of local expert j
        out = out.index_add(0, rows, xs[rows] @ w[j].T)
    y = comm.reduce_scatter(out, 0, group)                       # (T, h): each token's output, back home
    loss = 0.5 * (y ** 2).sum(dim=-1).mean()
    return torch.autograd.grad(loss, (router, w))


def expert_grads_unscaled(x, router, w, group):
    """Data-parallel gradients of an expert-parallel MoE layer, the experts' gradient left as backward made it."""
    router_grad, w_grad = _local_gradients(x, router, w, group)
    dist.all_reduce(router_grad, group=group)                    # replicated: average over the ranks
    router_grad /= dist.get_world_size(group)
    return router_grad, w_grad                                   # the experts: nothing to average?


def expert_grads(x, router, w, group):
    """Data-parallel gradients of an expert-parallel MoE layer, the experts' gradient divided by P."""
    router_grad, w_grad = _local_gradients(x, router, w, group)
    P = dist.get_world_size(group)
    dist.all_reduce(router_grad, group=group)
    router_grad /= P
    return router_grad, w_grad / P                               # it already sums over every rank's tokens


def expert_grads_router_unreduced(x, router, w, group):
    """Data-parallel gradients of an expert-parallel MoE layer, the router's gradient not all-reduced."""
    router_grad, w_grad = _local_gradients(x, router, w, group)
    return router_grad, w_grad / dist.get_world_size(group)      # the router: this rank's tokens only


def expert_grads_router_summed(x, router, w, group):
    """Data-parallel gradients of an expert-parallel MoE layer, the router's gradient summed over the ranks, not averaged."""
    router_grad, w_grad = _local_gradients(x, router, w, group)
    dist.all_reduce(router_grad, group=group)                    # P times the mean's gradient
    return router_grad, w_grad / dist.get_world_size(group)


hunt("expert_grad_scale", "test_expert_grads", {
    "unscaled": Implementation(expert_grads_unscaled, True,
                               "databricks/megablocks#20, deepspeedai/DeepSpeed#5259 and NVIDIA/Megatron-LM#5956"),
    "correct": Implementation(expert_grads, False),
    "router_unreduced": Implementation(expert_grads_router_unreduced, True, "NVIDIA/Megatron-LM#599"),
    "router_summed": Implementation(expert_grads_router_summed, True),
}, hint="give every rank tokens of its own, and compare both returned gradients — the router's and this rank's "
        "experts' — with those of the single-device layer whose loss is the mean of ½‖y‖² over all the group's "
        "tokens")
