"""Chapter 04's lab and bug hunt: ring attention from send and recv; a backward pass that reuses a stale block.

Lab (``solutions/labs/04_context_parallel.ipynb``). Each of the P ranks holds ``s/P``
consecutive tokens of q, k and v, laid out ``(b, a, s/P, d)`` (rank i: tokens i·s/P to
(i+1)·s/P − 1):

- ``ring_attention(q, k, v, group, causal)``: ``(out, lse)`` — this rank's rows of softmax
  attention over the whole sequence and the log-sum-exp of each of its query rows' scores.
  Its queries stay; the key/value blocks go round the ring, P − 1 moves of send/recv to the
  right neighbour, every rank passing on the block it received the step before, and the
  partial results merge with the log-sum-exp rule. The checks give every rank a query row
  with a score of 1000 (or more), where ``exp`` overflows even in float64: a merge that
  exponentiates a score or a log-sum-exp directly fails.
- ``RingAttention`` (the stretch part): an autograd function whose backward passes the
  blocks round again, each block's dK and dV travelling with it and one move further, home:
  P − 1 moves of K, V and P of dK, dV.

The checks compare with dense attention in float64 (outputs, log-sum-exps and the gradients
of q, k and v), causal or not, and follow every message: to the right neighbour only, the
bytes of the ring, and in the forward pass which rank's block each message carried (k and v
apart, or packed into one message), that no score matrix spans more than one block's keys,
that scores over one block's keys were computed before the last block arrived (at least P − 3
blocks' worth), and that when the last block has arrived no rank still holds three or more
other ranks' blocks (found by value, in any order, among the tensors alive in the rank: a
ring holds the block it computes on and at most the one before it) — in part 2 forward and
backward.
Collectives are refused while the learner's code runs, and so is the library's own ring
(:mod:`intralayer.context_parallel`).

Bug hunt: ``ring_attention(q, k, v, group)``, differentiable, with a correct forward pass.
The bug, from diffusers' ring attention (huggingface/diffusers#14265, fixed by #14274):
its backward rotates the key/value blocks round the ring but computes every step's
gradients against the block saved in the forward pass — this rank's own — so the remote
blocks never reach the gradient computation. The second buggy implementation, from
tt-metal's ring attention backward (tenstorrent/tt-metal#53205, fixed by #53216), computes
the softmax backward's correction D = rowsum(dO ⊙ O) from each block's own output instead
of the merged one: dV stays exact, dQ and dK do not. (Both are the course's rewrites of the
logic, not the projects' code.)
"""
from __future__ import annotations

import gc
import math

import torch
import torch.distributed as dist

from .parts import Implementation, Param, hunt, lab
from .common import calls_of, differ, earlier_part, group_info
from ..record import Call
from .runner import COLLECTIVES, FLIGHT, Mode, watch

#: float64. The longest sums are over s = 12 keys (and s·b rows of a gradient) of terms up to
#: ~1e3 in the loud rows' scores; their rounding stays below 2γ₁₂·1e3·12 ≈ 3e-11 relative to the
#: lse, and below 1e-12 in the outputs (probabilities and values of order 1). 1e-9 leaves a
#: margin and sits far below any wrong answer (a missing block shifts an output by ~0.1).
TOL = dict(rtol=1e-9, atol=1e-9)
B_, A_, SL_ = 2, 2, 3                        # b, heads a, tokens per rank s/P (the head dim d is a case parameter)
LOUD = 1000.0                                # a score of each loud row: exp(1000) overflows float64
PARAMS = {"causal": Param(False, (False, True)), "d": Param(4, (4, 8)), "seed": Param(0, minimum=0)}
WHY = ("this lab builds the ring from point-to-point sends and receives (dist.send/recv, isend/irecv, "
       "batch_isend_irecv), not from a collective or the library's own ring attention (intralayer.context_parallel)")


def inputs(case: dict, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole (b, a, s, d) q, k, v, the same on every rank; each rank's first query is loud.

    Rank r's first query scores exactly LOUD against the key of the token just before it (its
    own token on rank 0), so that block's log-sum-exp is at least 1000 (causal or not).
    """
    g = torch.Generator().manual_seed(1000 * case["seed"] + n)
    d = case["d"]
    Q, K, V = (torch.randn(B_, A_, SL_ * n, d, generator=g, dtype=torch.float64) for _ in range(3))
    for r in range(n):
        qpos = r * SL_
        key = K[:, :, max(qpos - 1, 0)]                                        # (b, a, d)
        Q[:, :, qpos] = LOUD * math.sqrt(d) * key / (key * key).sum(-1, keepdim=True)
    return Q, K, V


def dense(Q, K, V, causal: bool, scale: float | None = None):
    """Softmax attention over the whole sequence: (out, lse), differentiable; the scale 1/√d by default."""
    z = Q @ K.transpose(-2, -1) * (scale or 1 / math.sqrt(Q.shape[-1]))     # (b, a, s, s)
    if causal:
        s = z.shape[-1]
        z = z.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(z, -1)                                              # (b, a, s)
    return torch.softmax(z, -1) @ V, lse


def _mine(n: int, me: int) -> slice:
    return slice(me * SL_, (me + 1) * SL_)


def _block_label(piece: torch.Tensor, K, V, n: int) -> tuple[str, int] | None:
    """('key', r) or ('value', r) if ``piece`` (flattened) is rank r's key or value block."""
    for kind, whole in (("key", K), ("value", V)):
        for r in range(n):
            block = whole[:, :, _mine(n, r)].reshape(-1)
            if piece.numel() == block.numel() and piece.dtype == block.dtype and torch.equal(piece, block):
                return kind, r
    return None


def ring_links(calls, n: int, me: int) -> list[str]:
    """Problems with whom the messages went to and came from."""
    problems = []
    sends, recvs = calls_of(calls, "send"), calls_of(calls, "recv")
    right, left = (me + 1) % n, (me - 1) % n
    others = sorted({s.peer for s in sends if s.peer != right})
    if others:
        problems.append(f"it sent to group rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}: on a "
                        f"ring each rank sends only to its right neighbour, group rank {right}")
    sources = sorted({-1 if r.peer is None else r.peer for r in recvs if r.peer != left})
    if sources:
        said = ", ".join("any source" if s == -1 else str(s) for s in sources)
        problems.append(f"it received from {said}: on a ring each rank receives only from its left neighbour, "
                        f"group rank {left}")
    got, sent = sum(r.elements for r in recvs), sum(s.elements for s in sends)
    if got != sent:
        problems.append(f"it received {got} elements but sent {sent}: on a ring every rank receives as much as "
                        "it passes on")
    return problems


def _packed(data: torch.Tensor, K, V, n: int) -> list[tuple[str, int]] | None:
    """[('key', r), ('value', r)] (in the order packed) if one message is rank r's key and value blocks
    joined by torch.cat or torch.stack along any dimension, else None."""
    for r in range(n):
        blocks = {"key": K[:, :, _mine(n, r)], "value": V[:, :, _mine(n, r)]}
        for first, second in (("key", "value"), ("value", "key")):
            for join in (torch.cat, torch.stack):
                for dim in range(K.dim() + (join is torch.stack)):
                    joined = join([blocks[first], blocks[second]], dim)
                    if joined.shape == data.shape and torch.equal(joined, data):
                        return [(first, r), (second, r)]
    return None


def kv_messages(sends, K, V, n: int, me: int) -> list[str]:
    """Problems with what the forward pass's messages carried: at step j (1-based) a rank passes on
    the key and value blocks of group rank me − j + 1, the ones it received at step j − 1."""
    N = B_ * A_ * SL_ * K.shape[-1]
    labels = []
    for i, s in enumerate(sends):
        flat = s.data.reshape(-1)
        if flat.numel() % N:
            return [f"send {i + 1} held {flat.numel()} elements; a message holds whole key and value blocks of "
                    f"b·a·(s/P)·d = {N} elements each (send k and v apart, or packed with torch.cat or torch.stack)"]
        found = [_block_label(piece, K, V, n) for piece in flat.split(N)]
        if None in found and flat.numel() == 2 * N:
            found = _packed(s.data, K, V, n) or found
        if None in found:
            return [f"send {i + 1} carried values that are no rank's key or value block (alone, or the two packed "
                    "with torch.cat or torch.stack): pass the blocks on unchanged"]
        labels += found
    want = {(kind, (me - j) % n) for j in range(n - 1) for kind in ("key", "value")}
    problems = []
    for kind, r in sorted(want - set(labels), key=lambda x: ((me - x[1]) % n, x[0])):
        step = (me - r) % n
        problems.append(f"it never passed on group rank {r}'s {kind} block (the block it holds at step {step}); "
                        f"every block must reach all {n} ranks" + ("" if problems else f": {ORDER}"))
    twice = sorted({lab for lab in labels if labels.count(lab) > 1})
    if twice:
        kind, r = twice[0]
        problems.append(f"it passed on group rank {r}'s {kind} block {labels.count(twice[0])} times; each block "
                        "moves once per step")
    home = sorted({r for _, r in labels if (me - r) % n == n - 1})
    if home:
        problems.append(f"it passed on group rank {home[0]}'s block, which it received at the last step: that "
                        "block's next stop is its own rank, which needs no copy (P − 1 moves)")
    distances = [(me - r) % n for _, r in labels]
    if not problems and distances != sorted(distances):
        problems.append(f"it passed the blocks on out of ring order: {ORDER}")
    return problems


#: How the blocks go round, in the words of the task.
ORDER = ("at step j (j = 0 … P−1) rank i holds the block of rank (i − j) mod P — its own at step 0, its left "
         "neighbour's at step 1 — and at every step but the last it passes that block on to the right")

#: The aten operations whose result a score matrix or its softmax is (a view or copy is not).
_SCORE_OPS = {"bmm", "mm", "baddbmm", "addmm", "matmul", "_softmax", "_log_softmax", "exp", "logsumexp", "amax",
              "max", "sub", "div", "mul", "masked_fill", "where", "add", "_safe_softmax"}


class _ScoreWidths(Mode):
    """The widest key axis of any score matrix (…, s/P, w) the learner's code computed: ring attention
    works on one block of s/P keys at a time, so w > s/P means it held several blocks' keys at once.

    And, once: at the first score product after the last block has arrived (every receive posted and
    waited for), ``census()`` — which other ranks' blocks this rank's memory holds then."""

    def __init__(self, arrived=None, census=None):
        super().__init__()
        self.widest, self.op, self.early = 0, "", 0
        self.arrived, self.census, self.held = arrived, census, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        counted = name in _PRODUCTS | {"sum"}
        last_arrived = self.arrived is not None and (counted or self.held is None) and self.arrived()
        if self.held is None and self.census and last_arrived:      # the first operation after the last block
            self.held = self.census()
        out = func(*args, **(kwargs or {}))
        if self.arrived is not None and not last_arrived and counted and isinstance(out, torch.Tensor) and \
                out.is_floating_point() and out.dim() >= 2 and max(out.shape[-2:]) == SL_:
            self.early += 1                  # block-sized scores (s/P keys by up to s/P queries, or transposed)
        if name in _SCORE_OPS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 and t.shape[-2] == SL_ \
                        and t.shape[-1] > self.widest and t.shape[-1] >= 2 * SL_ and t.shape[-1] % SL_ == 0:
                    self.widest, self.op = t.shape[-1], name
        return out


_PRODUCTS = {"bmm", "mm", "baddbmm", "addmm", "matmul"}


def _blocks_in_memory(K, V, n: int, me: int, skip: list[torch.Tensor]) -> list[int]:
    """The group ranks other than ``me`` whose key or value block some tensor alive in this process holds
    (the tensor itself, or an aligned stretch of a larger buffer it views; its values in any order, so a
    transposed copy counts), found by value among every
    object the garbage collector tracks. ``skip``: the check's own tensors (the whole K and V, the copies
    the monitor keeps of what was sent)."""
    N = B_ * A_ * SL_ * K.shape[-1]
    wanted = [(r, whole[:, :, _mine(n, r)].reshape(-1).sort().values) for whole in (K, V)
              for r in range(n) if r != me]
    copies = [o.data for o in gc.get_objects() if type(o) is Call and o.data is not None]      # the recorder's
    seen = {t.untyped_storage().data_ptr() for t in skip + copies + [block for _, block in wanted]}
    found = set()
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.dtype != torch.float64 or obj.layout != torch.strided:
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):              # a tensor without storage of its own
            continue
        if storage.data_ptr() in seen or storage.nbytes() < N * 8:
            continue
        seen.add(storage.data_ptr())
        flat = torch.empty(0, dtype=torch.float64).set_(storage)
        for start in range(0, flat.numel() - N + 1, N):
            piece = flat[start:start + N].sort().values              # the block's values in any layout
            found.update(r for r, block in wanted if torch.equal(piece, block))
    return sorted(found)


def _held_problem(held: list[int] | None, n: int) -> list[str]:
    """Ring attention holds the block it computes on and at most the one before it (in flight or just
    passed on); holding three or more other ranks' blocks at the last step means it kept them all. So
    only cases of 4 ranks or more can tell (on 2 or 3 ranks a ring that keeps everything holds 1 or 2);
    the visible 4-rank case does."""
    if not held or len(held) < 3:
        return []
    return [f"when the last block arrived this rank still held the key/value blocks of group ranks {held} "
            f"({len(held)} of the {n - 1} it receives): ring attention keeps only the block it computes on (and "
            "the one in flight), merges it into (out, lse) and lets it go; keeping every block costs the memory "
            "of the whole sequence's keys and values, which ring attention exists to save"]


def _one_block_at_a_time(widths: _ScoreWidths, n: int) -> list[str]:
    if not widths.widest:
        return []
    blocks = widths.widest // SL_
    return [f"it computed scores (or their softmax) over {widths.widest} keys at once — {blocks} ranks' blocks, "
            f"seen in torch's {widths.op} — where ring attention holds one block of s/P = {SL_} keys at a time and "
            "merges each block's partial result (out, lse) into the running one with the log-sum-exp rule as it "
            "arrives: gathering the blocks for one dense softmax needs the memory ring attention exists to save"]


def _merged_as_they_came(widths: _ScoreWidths, n: int, me: int, causal: bool) -> list[str]:
    """Ring attention computes on each block while it holds it, so before the last block arrives it has computed
    the scores of at least P − 3 blocks (it may compute a block after passing it on, and its own last): causal,
    of min(me, P − 3), the blocks it needs (its own and those of the ranks before it). A score product is over
    one block's keys (s/P by up to s/P, either way round: a row at a time counts too); a rank that computes
    only after every block has come holds them all, however it lays its scores out."""
    need = max(0, min(me, n - 3) if causal else n - 3)
    if widths.early >= need:
        return []
    return [f"before the last block arrived it had made {widths.early} score product"
            f"{'' if widths.early == 1 else 's'} over one block's keys (s/P = {SL_}); ring attention computes on "
            f"each block while it holds it and merges the result into (out, lse) — on {n} ranks at least {need} "
            "before the last block arrives — so that it never needs the whole sequence's keys and values at once: "
            "computing only after every block has arrived means holding them all"]


def _bytes_problem(sends, want: int, formula: str) -> list[str]:
    sent = sum(s.bytes for s in sends)
    return [] if sent == want else [f"it sent {sent} bytes; {formula} = {want} bytes"]


def _diagnose(got, want: torch.Tensor, what: str, others: dict[str, torch.Tensor]) -> str:
    """Words for a wrong output or lse: an overflow, or which wrong answer it equals."""
    if isinstance(got, torch.Tensor) and got.shape == want.shape and not bool(torch.isfinite(got).all()):
        rows = sorted({int(i) for i in torch.nonzero(~torch.isfinite(got))[:, 2]})
        return (f"; {what} holds NaN or inf in query row{'s' if len(rows) > 1 else ''} {rows} of this rank (row 0 "
                f"holds a score of {LOUD:.0f}): exp of a score or of a log-sum-exp that large "
                "overflows — merge with the larger log-sum-exp subtracted first (chapter 04's merge)")
    for words, value in others.items():
        if isinstance(got, torch.Tensor) and got.shape == value.shape and torch.allclose(got, value, **TOL):
            return f"; it is {words}"
    return ""


def _wrong_attention(Q, K, V, n: int, me: int, causal: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Plausible wrong results, for the words of a failing check: attention to this rank's own block only,
    and attention with the other masking."""
    mine = _mine(n, me)
    own_out, own_lse = dense(Q[:, :, mine], K[:, :, mine], V[:, :, mine], causal)
    flip_out, flip_lse = dense(Q, K, V, not causal)
    other = "with a causal mask, though this case has none" if not causal else \
        "without the causal mask: a query sees only the keys at or before its position"
    wrongs = {"out": {"attention to this rank's own keys only: the other ranks' blocks never arrived or never "
                      "merged": own_out, other: flip_out[:, :, mine]},
              "lse": {"the log-sum-exp over this rank's own keys only": own_lse, other: flip_lse[:, :, mine]}}
    d = Q.shape[-1]
    for wrong_d in {4, 8} - {d}:            # the scale of the other head dim: a hard-coded 1/√d
        out, lse = dense(Q, K, V, causal, 1 / math.sqrt(wrong_d))
        words = (f"attention with the scores scaled by 1/√{wrong_d}, though this case's head dim is d = {d}: take "
                 "d from q.shape[-1]")
        wrongs["out"][words], wrongs["lse"][words] = out[:, :, mine], lse[:, :, mine]
    return wrongs


# ---------------------------------------------------------------------------- part 1: the forward ring

def _summary_forward(facts: dict) -> str:
    return (f"{facts['n']} ranks{', causal' if facts['causal'] else ''}, d = {facts['d']}: out and lse equal dense attention's "
            f"(loud rows included); each rank passed {facts['n'] - 1} key/value block pair"
            f"{'s' if facts['n'] > 2 else ''} to its right neighbour, {facts['sent']} bytes = "
            "(P−1)·2·b·a·(s/P)·d·e")


@lab("ring_attention", ("ring_attention",), params=PARAMS, forbid_ops=COLLECTIVES,
     forbid_modules=("intralayer.context_parallel",), why=WHY, summary=_summary_forward)
def check_forward(ns, case, group) -> dict:
    n, me = group_info(group)
    causal = case["causal"]
    Q, K, V = inputs(case, n)
    mine = _mine(n, me)
    q, k, v = (t[:, :, mine].clone() for t in (Q, K, V))
    N = B_ * A_ * SL_ * K.shape[-1]
    with watch() as calls:
        arrived = lambda: (sum(c.elements for c in calls_of(calls, "recv")) >= 2 * (n - 1) * N
                           and not FLIGHT["pending"])
        census = lambda: _blocks_in_memory(K, V, n, me, [Q, K, V] + [c.data for c in calls_of(calls, "send")])
        with _ScoreWidths(arrived, census) as widths:
            got = ns.ring_attention(q, k, v, group, causal)
    out_d, lse_d = dense(Q, K, V, causal)
    problems = []
    if not (isinstance(got, tuple) and len(got) == 2):
        what = f"a tuple of {len(got)}" if isinstance(got, tuple) else f"a {type(got).__name__}"
        problems.append(f"ring_attention returned {what}; it should return (out, lse): this rank's (b, a, s/P, d) "
                        "rows of the output and their (b, a, s/P) log-sum-exps")
    else:
        wrongs = _wrong_attention(Q, K, V, n, me, causal)
        for value, want, name in ((got[0], out_d[:, :, mine], "out"), (got[1], lse_d[:, :, mine], "lse")):
            wrong = differ(value, want, name, **TOL)
            if wrong:
                problems.append(wrong + _diagnose(value, want, name, wrongs[name]))
    problems += ring_links(calls, n, me)
    sends = calls_of(calls, "send")
    block = B_ * A_ * SL_ * Q.shape[-1] * Q.element_size()
    problems += _bytes_problem(sends, 2 * (n - 1) * block, f"a ring passes every key and value block on P − 1 "
                               f"times (P = {n}): (P−1)·2·b·a·(s/P)·d·e")
    problems += kv_messages(sends, K, V, n, me)
    problems += _one_block_at_a_time(widths, n) + _held_problem(widths.held, n)
    problems += [] if problems else _merged_as_they_came(widths, n, me, causal)
    return {"problems": problems, "facts": {"n": n, "causal": causal, "d": case["d"],
                                                "sent": sum(s.bytes for s in sends)}}


# ---------------------------------------------------------------------------- part 2: the backward ring

def _summary_backward(facts: dict) -> str:
    moves = f"{facts['n'] - 1} move{'s' if facts['n'] > 2 else ''} of K, V"
    return (f"{facts['n']} ranks{', causal' if facts['causal'] else ''}, d = {facts['d']}: out and the gradients of q, k and v equal "
            f"dense attention's; forward {facts['forward']} bytes ({moves}), backward {facts['backward']} bytes "
            f"({moves} and {facts['n']} of dK, dV)")


@lab("ring_attention_backward", ("RingAttention",), params=PARAMS, forbid_ops=COLLECTIVES,
     forbid_modules=("intralayer.context_parallel",), why=WHY, summary=_summary_backward)
def check_backward(ns, case, group) -> dict:
    n, me = group_info(group)
    earlier = earlier_part(ns, "ring_attention", 1, check_forward, case, group)
    causal = case["causal"]
    Q, K, V = inputs(case, n)
    U = torch.randn(Q.shape, generator=torch.Generator().manual_seed(5 + case["seed"]), dtype=torch.float64)
    Ql, Kl, Vl = (t.clone().requires_grad_() for t in (Q, K, V))
    out_d, _ = dense(Ql, Kl, Vl, causal)
    (out_d * U).sum().backward()                                              # the loss of every rank's rows
    mine = _mine(n, me)
    q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (Q, K, V))
    N = B_ * A_ * SL_ * K.shape[-1]
    with watch() as forward:
        arrived = lambda: (sum(c.elements for c in calls_of(forward, "recv")) >= 2 * (n - 1) * N
                           and not FLIGHT["pending"])
        census = lambda: _blocks_in_memory(K, V, n, me, [Q, K, V, Ql, Kl, Vl]
                                           + [c.data for c in calls_of(forward, "send")])
        with _ScoreWidths(arrived, census) as widths:
            out = ns.RingAttention.apply(q, k, v, group, causal)
    problems = []
    block = B_ * A_ * SL_ * Q.shape[-1] * Q.element_size()
    wrong = differ(out, out_d.detach()[:, :, mine], "the output", **TOL)
    if wrong:
        problems.append(wrong + _diagnose(out, out_d.detach()[:, :, mine], "the output", {}))
    problems += [f"the forward pass: {p}" for p in ring_links(forward, n, me) + _bytes_problem(
        calls_of(forward, "send"), 2 * (n - 1) * block, f"the forward pass moves each key and value block P − 1 "
        f"times (P = {n}): (P−1)·2·b·a·(s/P)·d·e")]
    ring = _one_block_at_a_time(widths, n) + _held_problem(widths.held, n)
    problems += [f"the forward pass: {p}" for p in ring or _merged_as_they_came(widths, n, me, causal)]
    backward = []
    if isinstance(out, torch.Tensor) and out.requires_grad and out.shape == q.shape:
        with watch() as backward:
            arrived = lambda: (sum(c.elements for c in calls_of(backward, "recv")) >= 2 * (n - 1) * N
                               and not FLIGHT["pending"])   # as many numbers as P − 1 moves of K and V
            census = lambda: _blocks_in_memory(K, V, n, me, [Q, K, V, Ql, Kl, Vl]
                                               + [c.data for c in calls_of(forward + backward, "send")])
            with _ScoreWidths(arrived, census) as widths:
                out.backward(U[:, :, mine].clone())
        problems += [f"the backward pass: {p}" for p in _one_block_at_a_time(widths, n) + _held_problem(widths.held, n)]
        grads = {"q": (q.grad, Ql.grad[:, :, mine]), "k": (k.grad, Kl.grad[:, :, mine]),
                 "v": (v.grad, Vl.grad[:, :, mine])}
        bad = []
        for name, (got, want) in grads.items():
            wrong = differ(got, want, f"{name}.grad", **TOL)
            if wrong:
                bad.append(name)
                problems.append(wrong + _diagnose(got, want, f"{name}.grad", {}))
        if bad and "v" not in bad:
            problems.append("v.grad is right but " + " and ".join(f"{b}.grad" for b in bad)
                            + (" is" if len(bad) == 1 else " are") + " not: the softmax backward's "
                            "D = rowsum(dO ⊙ O) needs the final output O, merged over every block, and each "
                            "block's probabilities exp(z − lse) the final lse")
        problems += [f"the backward pass: {p}" for p in ring_links(backward, n, me) + _bytes_problem(
            calls_of(backward, "send"), (2 * n - 1) * 2 * block, f"the backward pass moves K and V P − 1 times and "
            f"dK and dV P times (with their block, then home; P = {n}): (2P−1)·2·b·a·(s/P)·d·e")]
    elif isinstance(out, torch.Tensor) and not out.requires_grad:
        problems.append("the output does not require a gradient: return a tensor computed in forward, as "
                        "torch.autograd.Function.apply does")
    if earlier:                              # what the rest found would only repeat it
        return {"problems": earlier, "facts": {}}
    return {"problems": problems, "facts": {"n": n, "causal": causal, "d": case["d"],
                                            "forward": sum(s.bytes for s in calls_of(forward, "send")),
                                            "backward": sum(s.bytes for s in calls_of(backward, "send"))}}


# ---------------------------------------------------------------------------- bug hunt: the backward's blocks

def _ring_step(tensors, group):
    """One move round the ring: send each tensor to the right neighbour, receive the left one's."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    incoming = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=(me + 1) % P) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(me - 1) % P) for t in incoming]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return incoming


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])                # (b, a, s/P, s/P)


def _ring_forward(q, k, v, group):
    """Every block's attention, merged by log-sum-exp as the blocks go round: (out, lse)."""
    P = dist.get_world_size(group)
    held = [k, v]
    for step in range(P):
        z = _scores(q, held[0])
        block_lse = torch.logsumexp(z, -1)                                   # (b, a, s/P)
        block_out = torch.exp(z - block_lse[..., None]) @ held[1]            # (b, a, s/P, d)
        if step == 0:
            out, lse = block_out, block_lse
        else:
            new = torch.logaddexp(lse, block_lse)
            out = torch.exp(lse - new)[..., None] * out + torch.exp(block_lse - new)[..., None] * block_out
            lse = new
        if step < P - 1:
            held = _ring_step(held, group)
    return out, lse


class RingAttentionStaleKV(torch.autograd.Function):
    """Ring attention whose backward computes every step against the block saved in the forward pass."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        out, lse = _ring_forward(q, k, v, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        P, scale = dist.get_world_size(ctx.group), 1 / math.sqrt(q.shape[-1])
        delta = (dout * out).sum(-1, keepdim=True)                           # D = rowsum(dO ⊙ O)
        dq, held, moving = torch.zeros_like(q), [k, v], [torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(P):
            kb, vb = k, v                      # the blocks saved in forward (this rank's own), not `held`
            p = torch.exp(_scores(q, kb) - lse[..., None])                   # the softmax's columns of this block
            ds = p * (dout @ vb.transpose(-2, -1) - delta)
            dq += ds @ kb * scale
            moving = [moving[0] + ds.transpose(-2, -1) @ q * scale, moving[1] + p.transpose(-2, -1) @ dout]
            moving = _ring_step(moving, ctx.group)                           # dK, dV travel with their block
            if step < P - 1:
                held = _ring_step(held, ctx.group)
        return dq, moving[0], moving[1], None


class RingAttentionCorrect(torch.autograd.Function):
    """Ring attention whose backward computes each step against the block it holds."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        out, lse = _ring_forward(q, k, v, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        P, scale = dist.get_world_size(ctx.group), 1 / math.sqrt(q.shape[-1])
        delta = (dout * out).sum(-1, keepdim=True)                           # D = rowsum(dO ⊙ O)
        dq, held, moving = torch.zeros_like(q), [k, v], [torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(P):
            kb, vb = held
            p = torch.exp(_scores(q, kb) - lse[..., None])
            ds = p * (dout @ vb.transpose(-2, -1) - delta)
            dq += ds @ kb * scale
            moving = [moving[0] + ds.transpose(-2, -1) @ q * scale, moving[1] + p.transpose(-2, -1) @ dout]
            moving = _ring_step(moving, ctx.group)
            if step < P - 1:
                held = _ring_step(held, ctx.group)
        return dq, moving[0], moving[1], None


class RingAttentionBlockD(torch.autograd.Function):
    """Ring attention whose backward takes D = rowsum(dO ⊙ O) from each block's own output."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        out, lse = _ring_forward(q, k, v, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        P, scale = dist.get_world_size(ctx.group), 1 / math.sqrt(q.shape[-1])
        dq, held, moving = torch.zeros_like(q), [k, v], [torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(P):
            kb, vb = held
            z = _scores(q, kb)
            p = torch.exp(z - lse[..., None])
            block_out = torch.softmax(z, -1) @ vb                            # this block's own output O_j
            ds = p * (dout @ vb.transpose(-2, -1) - (dout * block_out).sum(-1, keepdim=True))   # D from O_j
            dq += ds @ kb * scale
            moving = [moving[0] + ds.transpose(-2, -1) @ q * scale, moving[1] + p.transpose(-2, -1) @ dout]
            moving = _ring_step(moving, ctx.group)
            if step < P - 1:
                held = _ring_step(held, ctx.group)
        return dq, moving[0], moving[1], None


def ring_attention_stale_kv(q, k, v, group):
    """Ring attention whose backward reuses this rank's own key/value block at every step."""
    return RingAttentionStaleKV.apply(q, k, v, group)


def ring_attention_correct(q, k, v, group):
    """Ring attention, forward and backward."""
    return RingAttentionCorrect.apply(q, k, v, group)


def ring_attention_block_d(q, k, v, group):
    """Ring attention whose backward takes D from each block's own output."""
    return RingAttentionBlockD.apply(q, k, v, group)


hunt("ring_backward_blocks", "test_ring_attention", {
    "stale_kv": Implementation(ring_attention_stale_kv, True, "huggingface/diffusers#14265"),
    "correct": Implementation(ring_attention_correct, False),
    "block_d": Implementation(ring_attention_block_d, True, "tenstorrent/tt-metal#53205"),
}, hint="the forward pass is right in every version, and one of them gets v's gradient right: compare the "
        "gradients of q, k and v — all three — with those of dense attention over the whole sequence, on every "
        "rank, with keys and values that differ from rank to rank")
