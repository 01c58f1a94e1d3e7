"""Chapter 05's lab and bug hunt: capacity-limited dispatch and combine; the balance loss under capacity.

Lab (``solutions/labs/05_moe.ipynb``): an MoE layer's data movement, in torch, forward and backward.

- ``dispatch(x, expert_index, experts, capacity)``: x is this rank's (T, h) tokens,
  expert_index the router's (T, k) choices, best first. Return ``(buffer, slot)``: the
  (E, C, h) buffer whose row ``buffer[e, c]`` holds the token in place c of expert e's
  queue (zeros where the queue is shorter), and the (T, k) place of every assignment, −1
  for one dropped because its expert was full. Queues fill in GShard's order: every
  token's first choice in token order, then every second choice, … (chapter 05's
  ``topk_route``). The buffer must carry x's gradient back: each token gets the sum of
  its kept copies' gradients.
- ``combine(expert_out, slot, expert_index, weights)``: the (T, h) output, each token the
  weighted sum of its kept assignments' rows of the experts' (E, C, h) output. The check
  builds a whole MoE layer around it (a router, the reference dispatch, SwiGLU experts
  run once per expert on the padded buffer) and compares it with a per-token loop —
  chapter 05's reference, rewritten here — in the output and in the gradients of x, the
  router and every expert weight.

Each rank of groups of 2, 3 and 4 runs the learner's function on tokens of its own (their
number differs from rank to rank); routing is per-rank arithmetic, so the checks also
insist that nothing is sent. Integer-valued inputs make the dispatch exact; the combine
runs in float64 with a derived tolerance.

Bug hunt: ``balance_loss(logits, expert_index, kept, group)`` returns this rank's share of
the Switch balance loss E·Σ f_i π_i of the whole group's batch (the shares sum to it, as
Megatron-Core splits the loss over the ranks that hold parts of one batch), with f_i the
fraction of the router's choices that picked expert i. The bug, reported against
Megatron-LM (NVIDIA/Megatron-LM#1513; fixed by recomputing the top-k map for the loss,
commit cfe7b066c0): f counted only the assignments kept under capacity, so dropping
tokens made the loss smaller just when the router was least balanced. The hidden variant,
the course's own, counts only this rank's choices instead of the whole group's.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .parts import Implementation, Param, hunt, lab
from .common import differ, earlier_part, group_info, traffic
from .runner import watch

E_, H_, F_ = 5, 4, 6                   # experts, hidden size, expert width
#: float64: the longest reduction is an F_ = 6-term row of an expert's down projection
#: (and a weight gradient's sum over a rank's ≤ 13 tokens, k ≤ 3 copies each); 2γ_n·Σ|terms|
#: with n ≤ 40 and Σ|terms| ≲ 100 is ≈ 1e-12, so 1e-10 is a wide margin that still sits
#: orders of magnitude below a wrong answer's error (a missing weight or row is of order 0.1).
TOL = dict(rtol=1e-10, atol=1e-10)
PARAMS = {"seed": Param(0, minimum=0), "k": Param(2, (1, 2, 3)),
          "capacity_factor": Param(1.0, (0.5, 1.0, 1.25, 2.0))}
WHY = ("intralayer.moe and intralayer.expert_parallel hold the course's own routing, dispatch and combine "
       "(topk_route, Route.assignments, MoELayer), the answers to this lab: write them with torch")


def capacity(tokens: int, k: int, capacity_factor: float, experts: int = E_) -> int:
    """⌈cf·T·k/E⌉ (chapter 05), the ``- 1e-9`` keeping a whole product computed a hair high from rounding up."""
    return math.ceil(capacity_factor * tokens * k / experts - 1e-9)


def tokens_of(me: int) -> int:
    """Every rank has a number of tokens of its own: 7, 9, 11, 13 for group ranks 0–3."""
    return 7 + 2 * me


def routing(case: dict, me: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Group rank ``me``'s integer-valued tokens (T, h), its router's choices (T, k) and the capacity.

    The choices are skewed towards the last experts, so capacity binds; on group rank 0
    no token chooses expert 0, an expert with an empty queue.
    """
    g = torch.Generator().manual_seed(1000 * case["seed"] + me)
    T, k = tokens_of(me), case["k"]
    x = torch.randint(-6, 7, (T, H_), generator=g).to(torch.float64)
    popularity = torch.tensor([0.0 if me == 0 else 0.6, 1.0, 1.5, 2.5, 4.0], dtype=torch.float64)
    expert_index = torch.multinomial(popularity.expand(T, E_), k, replacement=False, generator=g)
    return x, expert_index, capacity(T, k, case["capacity_factor"])


def queue_slots(expert_index: torch.Tensor, experts: int, cap: int, token_major: bool = False) -> torch.Tensor:
    """Each assignment's place in its expert's queue, −1 if the queue was full: (T, k) int64.

    GShard's order (choice rank first, then token order); ``token_major`` is the common
    mistake of serving token 0's choices, then token 1's, … (for the check's diagnosis).
    """
    T, k = expert_index.shape
    used = [0] * experts
    slot = torch.full((T, k), -1, dtype=torch.int64)
    order = [(t, j) for t in range(T) for j in range(k)] if token_major else \
        [(t, j) for j in range(k) for t in range(T)]
    for t, j in order:
        e = int(expert_index[t, j])
        if used[e] < cap:
            slot[t, j] = used[e]
            used[e] += 1
    return slot


def buffer_of(x: torch.Tensor, expert_index: torch.Tensor, slot: torch.Tensor, experts: int, cap: int) -> torch.Tensor:
    """The (E, C, h) buffer for given places, built one assignment at a time."""
    buffer = x.new_zeros(experts, cap, x.shape[1])
    for t, j in zip(*torch.nonzero(slot >= 0, as_tuple=True)):
        buffer[expert_index[t, j], slot[t, j]] = x[t]
    return buffer


def _slot_words(got: torch.Tensor, want: torch.Tensor, expert_index: torch.Tensor, cap: int) -> str:
    """Why the returned places are wrong, in words."""
    if torch.equal(got, queue_slots(expert_index, E_, cap, token_major=True)):
        return ("the queues were filled token by token (token 0's choices, then token 1's, …); GShard serves "
                "every token's first choice before any second choice, then every second choice, …")
    if bool((got >= cap).any()):
        return (f"places go up to {int(got.max())}, past the capacity C = {cap} (places 0 to {cap - 1}): an expert "
                f"takes at most C assignments, the rest are dropped (place −1)")
    t, j = (int(i) for i in torch.nonzero(got != want)[0])
    e = int(expert_index[t, j])
    should = (f"be dropped (−1): expert {e}'s {cap} places were taken by assignments served before it"
              if int(want[t, j]) < 0 else f"be {int(want[t, j])}")
    said = f"token {t}'s choice {j + 1} (expert {e}) got place {int(got[t, j])}; it should {should}"
    if _queues_full_but_reordered(got, expert_index, cap):
        said = (f"every expert's queue holds as many assignments as it should, each place once, but not in "
                f"GShard's order (every first choice in token order, then every second choice, …): {said}. A sort "
                f"by expert reorders the assignments of one expert unless it is stable (torch.sort or "
                f"torch.argsort with stable=True)")
    return said


def _queues_full_but_reordered(got: torch.Tensor, expert_index: torch.Tensor, cap: int) -> bool:
    """Whether every queue has min(chosen, C) places 0, 1, …, each once: only the order is wrong."""
    for e in range(E_):
        chosen = int((expert_index == e).sum())
        places = sorted(int(c) for c in got[(expert_index == e) & (got >= 0)])
        if places != list(range(min(chosen, cap))):
            return False
    return True


def _buffer_words(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, expert_index: torch.Tensor,
                  slot: torch.Tensor) -> str:
    bad = torch.nonzero((got.detach() != want).any(-1))
    e, c = (int(i) for i in bad[0])
    owner = [(int(t), int(j)) for t, j in zip(*torch.nonzero((expert_index == e) & (slot == c), as_tuple=True))]
    should = (f"token {owner[0][0]}'s row (its choice {owner[0][1] + 1})" if owner
              else "zeros: no assignment has that place")
    held = [t for t in range(x.shape[0]) if torch.equal(got.detach()[e, c], x[t])]
    if held and (not owner or held[0] != owner[0][0]):
        holds = f"token {held[0]}'s row"
    else:
        holds = "zeros" if not bool(got.detach()[e, c].any()) else "something else"
    rows = got.shape[0] * got.shape[1]
    said = f"buffer[{e}, {c}] holds {holds}; it should hold {should} ({bad.shape[0]} of {rows} rows wrong)"
    other = next((q for q in range(want.shape[0]) if q != e and bool(want[q].any())
                  and torch.equal(got.detach()[e], want[q])), None)
    if other is not None:
        empty = [q for q in range(want.shape[0]) if not bool((expert_index == q).any())]
        said = f"buffer[{e}] holds expert {other}'s queue: {said}"
        if empty:
            said += (f". Expert {empty[0]} has an empty queue on this rank (no token chose it), and it still has "
                     f"its C rows in the buffer, zeros: index the buffer by the expert's number, not by its position "
                     f"among the experts that were chosen (torch.unique and a split by its counts skip an empty one)")
    return said


def _summary_dispatch(facts: dict) -> str:
    return (f"{facts['n']} ranks, each with tokens of its own (group rank 0: T = {facts['T']}, k = {facts['k']}, "
            f"capacity C = {facts['C']}): a ({E_}, {facts['C']}, {H_}) buffer, {facts['kept']} of {facts['A']} "
            f"assignments kept, {facts['A'] - facts['kept']} dropped, x.grad exact, nothing sent")


@lab("moe_dispatch", ("dispatch",), params=PARAMS, forbid_modules=("intralayer.expert_parallel", "intralayer.moe"),
     why=WHY, summary=_summary_dispatch)
def check_dispatch(ns, case, group) -> dict:
    n, me = group_info(group)
    x0, expert_index, cap = routing(case, me)
    T, k = expert_index.shape
    x = x0.clone().requires_grad_()
    with watch() as forward:
        out = ns.dispatch(x, expert_index.clone(), E_, cap)
    problems = []
    if forward:
        problems.append(f"dispatch sent {traffic(forward)}; it reorders this rank's own tokens: nothing to send")
    if not (isinstance(out, tuple) and len(out) == 2):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        return {"problems": problems + [f"dispatch returned {got}; it should return (buffer, slot)"], "facts": {}}
    buffer, slot = out
    want_slot = queue_slots(expert_index, E_, cap)
    wrong = differ(slot, want_slot, "slot")
    if wrong and isinstance(slot, torch.Tensor) and slot.shape == want_slot.shape and not slot.is_floating_point() \
            and not torch.equal(slot.to(torch.int64), want_slot):
        wrong = _slot_words(slot.to(torch.int64), want_slot, expert_index, cap)
    if wrong:
        problems.append(wrong + ("; places are whole numbers (torch.int64)" if "dtype" in wrong else ""))
    want_buf = buffer_of(x0, expert_index, want_slot, E_, cap)
    wrong = differ(buffer, want_buf, "buffer")
    if wrong and isinstance(buffer, torch.Tensor) and buffer.shape == want_buf.shape and buffer.dtype == x0.dtype:
        wrong = _buffer_words(buffer, want_buf, x0, expert_index, want_slot)
    elif wrong and isinstance(buffer, torch.Tensor) and buffer.shape != want_buf.shape:
        wrong += f" (E, C, h): one row per place of each expert's queue, C = {cap} places"
    if wrong:
        problems.append(wrong)
    elif not buffer.requires_grad:
        problems.append("buffer does not require a gradient: it was cut off from x (detach, .data, torch.no_grad "
                        "or a copy through NumPy); build it from x with indexing so the gradient flows back")
    else:
        upstream = torch.randint(-3, 4, want_buf.shape, generator=torch.Generator().manual_seed(50 + me)).to(x0.dtype)
        with watch() as backward:
            (buffer * upstream).sum().backward()
        want_grad = torch.zeros_like(x0)
        for t, j in zip(*torch.nonzero(want_slot >= 0, as_tuple=True)):
            want_grad[t] += upstream[expert_index[t, j], want_slot[t, j]]
        wrong = differ(x.grad, want_grad, "x.grad")
        if wrong:
            problems.append(wrong + "; each token's gradient is the sum of its kept copies' gradients (nothing "
                                    "for a dropped copy)")
        if backward:
            problems.append(f"the backward pass sent {traffic(backward)}; it should send nothing")
    kept = int((want_slot >= 0).sum())
    return {"problems": problems, "facts": {"n": n, "T": T, "k": k, "C": cap, "A": T * k, "kept": kept}}


# ---------------------------------------------------------------------------- the layer around combine

def layer(seed: int) -> dict[str, torch.Tensor]:
    """The router and the E SwiGLU experts, float64, the same on every rank."""
    g = torch.Generator().manual_seed(7 + seed)

    def rand(*shape, fan_in):
        return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)

    return {"router": rand(E_, H_, fan_in=1), "w1": rand(E_, F_, H_, fan_in=H_), "w3": rand(E_, F_, H_, fan_in=H_),
            "w2": rand(E_, H_, F_, fan_in=F_)}


def expert(p: dict, e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert e on rows (m, h): w2 · (silu(w1 x) ⊙ w3 x)."""
    return (F.silu(rows @ p["w1"][e].T) * (rows @ p["w3"][e].T)) @ p["w2"][e].T


def per_token_layer(x: torch.Tensor, p: dict, k: int, cap: int) -> torch.Tensor:
    """The reference: each token sorts its own scores; queues filled choice rank first, then token
    order; then one token and one kept expert at a time."""
    logits = x @ p["router"].T                                                   # (T, E)
    T = x.shape[0]
    chosen = [sorted(range(E_), key=lambda e: -row[e])[:k] for row in logits.tolist()]
    room, kept = [cap] * E_, [[False] * k for _ in range(T)]
    for j in range(k):
        for t in range(T):
            if room[chosen[t][j]] > 0:
                room[chosen[t][j]] -= 1
                kept[t][j] = True
    rows = []
    for t in range(T):
        w = torch.softmax(logits[t, chosen[t]], dim=0)                           # (k,)
        y = torch.zeros_like(x[t])
        for j in range(k):
            if kept[t][j]:
                y = y + w[j] * expert(p, chosen[t][j], x[t:t + 1])[0]
        rows.append(y)
    return torch.stack(rows)                                                     # (T, h)


def _combine_candidates(expert_out, slot, expert_index, weights) -> dict[str, torch.Tensor]:
    """Outputs of plausible wrong combines, to name the mistake."""
    T = slot.shape[0]
    kept = slot >= 0
    rows = expert_out[expert_index, slot.clamp(min=0)]                           # (T, k, h)
    last = expert_out[expert_index, slot]                                        # slot −1: the last place
    renorm = weights * kept / (weights * kept).sum(-1, keepdim=True).clamp(min=1e-300)
    return {
        "the unweighted sum of its kept rows: multiply each row by its weight":
            (rows * kept[..., None]).sum(1),
        "what you get when a dropped assignment (place −1) reads its expert's last place: skip dropped "
        "assignments, -1 indexes from the end":
            (last * weights[..., None]).sum(1),
        "the kept rows weighted by weights renormalized over the kept ones: keep the router's weights as "
        "they are (a dropped assignment's share is lost, not redistributed)":
            (rows * (renorm * kept)[..., None]).sum(1),
    } if T else {}


def _summary_combine(facts: dict) -> str:
    dropped = f"{facts['dropped']} assignment{'' if facts['dropped'] == 1 else 's'} dropped"
    return (f"{facts['n']} ranks, each with tokens of its own (group rank 0: T = {facts['T']}, k = {facts['k']}, "
            f"C = {facts['C']}, {dropped}): output and the gradients of x, the router and the experts' w1, w3, w2 "
            f"equal the per-token loop's; nothing sent")


@lab("moe_combine", ("combine",), params=PARAMS, forbid_modules=("intralayer.expert_parallel", "intralayer.moe"),
     why=WHY, summary=_summary_combine)
def check_combine(ns, case, group) -> dict:
    n, me = group_info(group)
    k = case["k"]
    T = tokens_of(me)
    cap = capacity(T, k, case["capacity_factor"])
    g = torch.Generator().manual_seed(100 * case["seed"] + 10 + me)
    x0 = torch.randn(T, H_, generator=g, dtype=torch.float64)
    upstream = torch.randn(T, H_, generator=g, dtype=torch.float64)
    dense = layer(case["seed"])
    ref = {name: v.clone().requires_grad_() for name, v in dense.items()}
    xr = x0.clone().requires_grad_()
    want = per_token_layer(xr, ref, k, cap)
    (want * upstream).sum().backward()
    # the layer around the learner's combine: router, reference dispatch, experts on the padded buffer
    p = {name: v.clone().requires_grad_() for name, v in dense.items()}
    x = x0.clone().requires_grad_()
    logits = x @ p["router"].T                                                   # (T, E)
    expert_index = logits.topk(k, dim=-1).indices                                # (T, k), best first
    weights = torch.softmax(logits.gather(1, expert_index), dim=-1)              # (T, k)
    slot = queue_slots(expert_index, E_, cap)
    buffer = buffer_of(x, expert_index, slot, E_, cap)                           # (E, C, h)
    expert_out = torch.stack([expert(p, e, buffer[e]) for e in range(E_)])       # (E, C, h)
    with watch() as forward:
        y = ns.combine(expert_out, slot.clone(), expert_index.clone(), weights)
    problems = []
    if forward:
        problems.append(f"combine sent {traffic(forward)}; on one rank it needs no communication")
    wrong = differ(y, want.detach(), "the output", **TOL)
    if wrong:
        if isinstance(y, torch.Tensor) and y.shape == want.shape:
            bad = int(torch.nonzero(((y.detach() - want.detach()).abs() > 1e-8).any(-1))[0])
            wrong += f"; token {bad}'s row is wrong"
            for words, value in _combine_candidates(expert_out.detach(), slot, expert_index, weights.detach()).items():
                if torch.allclose(y.detach(), value, **TOL):
                    wrong += f": every row is {words}"
                    break
        elif isinstance(y, torch.Tensor):
            wrong += ": one row per token"
        problems.append(wrong)
    elif not y.requires_grad:
        problems.append("the output does not require a gradient: combine must stay in the graph (no detach, "
                        ".item() or NumPy), so the gradients reach the experts and the router")
    else:
        with watch() as backward:
            (y * upstream).sum().backward()
        if backward:
            problems.append(f"the backward pass sent {traffic(backward)}; it should send nothing")
        through_out = "an expert's gradient comes through its rows of expert_out"
        why = {"x": "x's gradient comes through the buffer (the experts) and through the router's weights",
               "router": "the router learns only through the combine weights: keep `weights` in the graph "
                         "(no .detach(), .item() or .tolist() on them)",
               "w1": through_out, "w3": through_out, "w2": through_out}
        labels = {"router": "the router's gradient", "w1": "the gradient of w1", "w3": "the gradient of w3",
                  "w2": "the gradient of w2", "x": "x.grad"}
        for name, got, ref_grad in [(q, p[q].grad, ref[q].grad) for q in p] + [("x", x.grad, xr.grad)]:
            wrong = differ(got, ref_grad, labels[name], **TOL)
            if wrong:
                problems.append(wrong + f"; {why[name]}")
    dropped = int((queue_slots(expert_index.detach(), E_, cap) < 0).sum())
    return {"problems": problems, "facts": {"n": n, "T": T, "k": k, "C": cap, "dropped": dropped}}


# ---------------------------------------------------------------------------- bug hunt: the balance loss under capacity

def balance_loss_kept_only(logits, expert_index, kept, group):
    """Balance-loss share whose f counts only the assignments kept under capacity."""
    E, k = logits.shape[1], expert_index.shape[1]
    counts = torch.bincount(expert_index[kept], minlength=E).to(logits.dtype)   # (E,): kept assignments only
    dist.all_reduce(counts, group=group)                                         # over the group's whole batch
    tokens = torch.tensor([float(logits.shape[0])], dtype=logits.dtype)
    dist.all_reduce(tokens, group=group)                                         # T of the whole batch
    f = counts / (tokens * k)
    probs = torch.softmax(logits, dim=-1)                                        # (T, E)
    return E * (f * probs.sum(dim=0) / tokens).sum()                            # this rank's share


def balance_loss(logits, expert_index, kept, group):
    """Balance-loss share whose f counts every one of the router's choices."""
    E, k = logits.shape[1], expert_index.shape[1]
    counts = torch.bincount(expert_index.flatten(), minlength=E).to(logits.dtype)   # (E,): the router's choices
    dist.all_reduce(counts, group=group)
    tokens = torch.tensor([float(logits.shape[0])], dtype=logits.dtype)
    dist.all_reduce(tokens, group=group)
    f = counts / (tokens * k)
    probs = torch.softmax(logits, dim=-1)
    return E * (f * probs.sum(dim=0) / tokens).sum()


def balance_loss_local_counts(logits, expert_index, kept, group):
    """Balance-loss share whose f counts only this rank's choices."""
    E, k = logits.shape[1], expert_index.shape[1]
    counts = torch.bincount(expert_index.flatten(), minlength=E).to(logits.dtype)   # this rank's choices only
    f = counts / (logits.shape[0] * k)
    tokens = torch.tensor([float(logits.shape[0])], dtype=logits.dtype)
    dist.all_reduce(tokens, group=group)
    probs = torch.softmax(logits, dim=-1)
    return E * (f * probs.sum(dim=0) / tokens).sum()


def dispatch_first(part):
    """The bug hunt's test may call the learner's ``dispatch`` of part 1 for its kept mask: check that first,
    on part 1's visible case, so that a wrong dispatch is named as such (not as a test that misses the bug)."""
    run = part.run

    def wrapped(ns, case, group):
        earlier = earlier_part(ns, "dispatch", 1, check_dispatch, {"seed": 0, "k": 2, "capacity_factor": 1.0}, group)
        if earlier:
            raise AssertionError(earlier[0])             # its first problem: a message is cut at 400 characters
        return run(ns, case, group)

    part.run = wrapped
    return part


dispatch_first(hunt("balance_loss_capacity", "test_balance_loss", {
    "kept_only": Implementation(balance_loss_kept_only, True, "NVIDIA/Megatron-LM#1513"),
    "correct": Implementation(balance_loss, False),
    "local_counts": Implementation(balance_loss_local_counts, True),
}, hint="the bug needs assignments that capacity drops (kept must have a False) and a router whose choices are "
        "uneven; compare the sum of the ranks' shares with E·Σ f_i·π_i computed on one process from every "
        "rank's logits and choices"))
