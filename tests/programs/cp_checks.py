"""Check intralayer.context_parallel on real ranks against attention on the whole sequence.

Every rank builds the same q, k, v (and upstream gradient) for the whole sequence, runs
``scaled_dot_product_attention`` on it as the reference, then runs ring attention (every
layout of ``context_parallel.LAYOUTS``) and Ulysses on its own shards and compares its output shard and the gradients
of its q, k, v shards with the matching shards of the reference — for several shapes,
causal and not, in float32, float64 and bfloat16, and with scores of order 1e4. It also
checks ``shard_sequence`` / ``unshard_sequence`` (round trip and backward), the scores
each rank computes (``counting`` against ``work_per_rank``), the bytes each rank sends
(``comm.accounting`` against ``cp_costs``), and that bad input raises a ``ValueError``
that names the rule, before any rank communicates. Grouped-query attention (k, v with fewer
heads than q) is checked the same way; the backward's dk, dv moves must overlap the next
step's compute (the order of events); and ``intralayer.programs.cp_tp``'s attention layer,
tensor parallelism over heads composed with context parallelism over the sequence, must
equal the dense layer on every grid the world size allows with t ≤ 2.

Any mismatch raises, so the rank, and the launch, fail; when every check passed on
every rank, rank 0 prints ``MARKER`` followed by the number of ranks.

``python -m tests.programs.cp_checks float64-ring`` runs only the check of ring
attention at float64 tolerances (once a bug: the ring computed in float32 whatever the
input dtype).
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn.functional as F

from intralayer import comm, distributed
from intralayer import context_parallel as cp
from tests.programs.checks import EXACT, UNIT_ROUNDOFF, bounded, expect, close, raises, rounding_tol

# Tolerances: float32 ring or Ulysses against float32 SDPA at assert_close's float32
# defaults (checks.FLOAT32_REORDERED: ≤ 24 keys, d ≤ 8, ≤ 2P − 1 partial results merged);
# float64, bfloat16 and scores of order 1e4 at bounds derived from the arithmetic
# (attention_tol); results that are the same elementwise operations, EXACT.

MARKER = "CP CHECKS PASSED on ranks:"
FLOAT64_RING_MARKER = "CP FLOAT64 RING PASSED on ranks:"
METHODS = tuple(f"ring {layout}" for layout in cp.LAYOUTS) + ("ulysses",)

# The token positions rank r of P holds in a sequence of s tokens, written out from each
# layout's definition (the library derives them from its registry): a new layout needs one.
TOKENS = {
    "contiguous": lambda r, P, s: list(range(r * s // P, (r + 1) * s // P)),
    "zigzag": lambda r, P, s: (list(range(r * s // (2 * P), (r + 1) * s // (2 * P)))
                               + list(range((2 * P - 1 - r) * s // (2 * P), (2 * P - r) * s // (2 * P)))),
    "striped": lambda r, P, s: list(range(r, s, P)),                  # token i on rank i mod P
}


# ---------------------------------------------------------------------------- helpers

def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The same tensor on every rank (drawn in float64, then cast)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def layout_of(method: str) -> str:
    """The layout of a method's shards: the ring's own; Ulysses takes contiguous ones."""
    return method.removeprefix("ring ") if method.startswith("ring ") else "contiguous"


def run_method(method, q, k, v, group, causal):
    if method == "ulysses":
        return cp.ulysses_attention(q, k, v, group, causal)
    return cp.ring_attention(q, k, v, group, causal, layout=layout_of(method))


def methods_for(heads: int, P: int):
    return [m for m in METHODS if m != "ulysses" or heads % P == 0]


def reference(q, k, v, dout, causal, dtype):
    """SDPA on the whole sequence in ``dtype``: output and the gradients of q, k, v."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def parallel(method, q, k, v, dout, group, causal, transposed=False):
    """This rank's output shard and q, k, v shard gradients, with the counts and records."""
    lay = layout_of(method)
    if transposed:   # shards that are non-contiguous views: (b, s_local, heads, d) seen as (b, heads, s_local, d)
        mine = [cp.shard_sequence(t, 2, group, lay).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                for t in (q, k, v)]
        expect(not mine[0].is_contiguous(), "transposed shards should not be contiguous")
    else:
        mine = [cp.shard_sequence(t, 2, group, lay).requires_grad_() for t in (q, k, v)]
    with comm.accounting() as acc, cp.counting() as work:
        out = run_method(method, *mine, group, causal)
        fwd = acc.sent(phase="forward")
        out.backward(cp.shard_sequence(dout, 2, group, lay))
    got = {"out": out.detach(), "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
    return got, work, acc, fwd


def compare(got, ref, method, group, what, tol=None):
    """Shards of ``got`` against those of ``ref``: with no ``tol``, at the float32 defaults
    (checks.FLOAT32_REORDERED; a float64 reference is rounded to float32 first); else
    ``tol(key)`` gives ``rtol`` and a whole-sequence ``atol`` (sharded here), checked
    elementwise in ``ref``'s dtype (:func:`bounded`)."""
    lay = layout_of(method)
    for key in ("out", "dq", "dk", "dv"):
        want = cp.shard_sequence(ref[key], 2, group, lay)
        expect(got[key] is not None and got[key].shape == want.shape,
               f"{what} {key}: shape {None if got[key] is None else tuple(got[key].shape)}, want {tuple(want.shape)}")
        expect(bool(torch.isfinite(got[key]).all()), f"{what} {key}: not finite")
        if tol is None:
            close(got[key], want.to(got[key].dtype), f"{what} {key}")
        else:
            t = tol(key)
            bounded(got[key], want, f"{what} {key}", t["rtol"], cp.shard_sequence(t["atol"], 2, group, lay))


# ---------------------------------------------------------------------------- error bounds

def magnitudes(q, k, v, dout, causal):
    """Float64 magnitudes of the terms of attention's output and gradients (the ``mag`` of
    :func:`~tests.programs.checks.rounding_tol`, elementwise): p·|v|, |dS|·|k|·scale,
    |dS|ᵀ·|q|·scale and pᵀ·|dO| with |dS| ≤ p·(|dO|·|v|ᵀ + rowsum |dO ⊙ O|); and σ, the
    largest scale·Σ_i |q_i k_i| of a visible score, and W, the largest spread (max − min)
    of a row's visible scores."""
    q, k, v, do = (t.double() for t in (q, k, v, dout))
    scale = q.shape[-1] ** -0.5
    s = q @ k.transpose(-2, -1) * scale
    visible = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        visible = visible.tril()
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    out = p @ v
    mds = p * (do.abs() @ v.abs().transpose(-2, -1) + (do.abs() * out.abs()).sum(-1, keepdim=True))
    absprod = (q.abs() @ k.abs().transpose(-2, -1)) * scale
    spread = s.masked_fill(~visible, -math.inf).amax(-1) - s.masked_fill(~visible, math.inf).amin(-1)
    return dict(out=p @ v.abs(), dq=mds @ k.abs() * scale, dk=mds.transpose(-2, -1) @ q.abs() * scale,
                dv=p.transpose(-2, -1) @ do.abs(), sigma=float(absprod.masked_fill(~visible, 0).max()),
                spread=float(spread.max()))


def roundings(d, s, P, sigma, spread):
    """Roundings (units of u, relative to the magnitudes) of ring attention's output and of
    its gradients against exact attention: tests/test_numerics.py's model (its module
    docstring), with |s − m| and |m − M| bounded by the spread W (≤ 2σ) rather than 2σ:

    - the scores' own rounding, |δs| ≤ γ_{d+1}·σ, moves the output by ≤ 2|δs|: 2(d + 1)σ;
    - one block: 2W + 2s + 5 more; each of at most 2P − 1 ring merges 5W + 7 ln s + 12;
    - the backward's p: 2(d + 1)σ + 3W + 3 ln s + s + 4 and the merges; then 2d + 2s + 6.
    """
    merges = (2 * P - 1) * (5 * spread + 7 * math.log(s) + 12)
    n_out = 2 * (d + 1) * sigma + 2 * spread + 2 * s + 5 + merges
    n_p = 2 * (d + 1) * sigma + 3 * spread + 3 * math.log(s) + s + 4 + merges
    return n_out, max(n_out, n_p) + 2 * d + 2 * s + 6


def attention_tol(dtype, q, k, v, dout, causal, P, both=2, extra=0):
    """``tol(key)`` for :func:`compare`, on whole-sequence q, k, v, dout: :func:`rounding_tol` of
    ``dtype`` (float32 work for bfloat16) with n from :func:`roundings` (an upper bound for
    Ulysses' SDPA too, which merges nothing), times ``both`` when the reference rounds in
    the same work dtype, and the elementwise magnitudes of :func:`magnitudes`; ``extra``
    more roundings to ``dtype`` itself add extra·u(dtype)·mag."""
    mag = magnitudes(q, k, v, dout, causal)
    n_out, n_grad = roundings(q.shape[-1], q.shape[2], P, mag["sigma"], mag["spread"])

    def tol(key):
        t = rounding_tol(dtype, both * (n_out if key == "out" else n_grad), mag[key])
        return dict(rtol=t["rtol"], atol=t["atol"] + extra * UNIT_ROUNDOFF[dtype] * mag[key])
    return tol


def check_costs(method, work, acc, fwd, s, b, heads, d, P, r, causal, itemsize, what, kv_heads=None):
    """Bytes sent against cp_costs; for the ring, scores computed against work_per_rank."""
    lay = layout_of(method)
    costs = cp.cp_costs(s, b, heads, d, P, "ulysses" if method == "ulysses" else "ring", causal, lay,
                        itemsize=itemsize, kv_heads=kv_heads)
    expect(fwd == costs["forward"], f"{what}: sent {fwd} bytes forward, cp_costs says {costs['forward']}")
    bwd = acc.sent(phase="backward")
    expect(bwd == costs["backward"], f"{what}: sent {bwd} bytes backward, cp_costs says {costs['backward']}")
    expect(acc.sent() == costs["sent"], f"{what}: sent {acc.sent()} bytes in all, cp_costs says {costs['sent']}")
    if method == "ulysses":
        expect(acc.count("all_to_all", "forward") == 4 and acc.count("all_to_all", "backward") == 4,
               f"{what}: want 4 all-to-alls each way: {acc.table()}")
        expect(work.scores == 0, f"{what}: Ulysses counted {work.scores} ring scores")
        return
    expect(acc.count("send", "forward") == P - 1, f"{what}: {acc.count('send', 'forward')} forward sends")
    expect(acc.count("send", "backward") == (2 * P - 1 if P > 1 else 0),
           f"{what}: {acc.count('send', 'backward')} backward sends")
    want = cp.work_per_rank(s, P, lay, causal)[r] * b * heads
    expect(work.scores == want, f"{what}: counted {work.scores} scores, work_per_rank says {want}")
    expect(sum(work.steps) == work.scores and len(work.steps) == P, f"{what}: steps {work.steps}")
    plan = cp.schedule(r, P, lay, causal)
    expect(work.blocks == sum(len(step) for step in plan), f"{what}: {work.blocks} blocks")
    piece = s // cp.n_chunks(P, lay)
    expect(work.steps == [len(step) * piece * piece * b * heads for step in plan],
           f"{what}: steps {work.steps} against the schedule")


# ---------------------------------------------------------------------------- attention

def shapes(P):
    """(b, heads, s_local, d): Ulysses runs where P divides heads."""
    return [
        (2, 4, 4, 8),       # Ulysses on 2 and 4 ranks
        (1, 3, 2, 1),       # b = 1, odd heads (no Ulysses), s_local = 2 (zigzag pieces of 1), d = 1
        (2, 4, 2, 3),       # s_local = 2, d = 3
        (1, 2 * P, 6, 4),   # several heads per rank under Ulysses, zigzag pieces of 3
    ]


def check_float32(P, r, group):
    for i, (b, heads, sl, d) in enumerate(shapes(P)):
        s = sl * P
        q, k, v, dout = (randn(b, heads, s, d, seed=100 * i + j) for j in range(4))
        for causal in (False, True):
            ref = reference(q, k, v, dout, causal, torch.float32)
            for method in methods_for(heads, P):
                what = f"float32 {method} causal={causal} (b, heads, s_local, d)={(b, heads, sl, d)}"
                got, work, acc, fwd = parallel(method, q, k, v, dout, group, causal)
                expect(got["out"].dtype == torch.float32, f"{what}: output dtype {got['out'].dtype}")
                compare(got, ref, method, group, what)                      # float32 defaults
                whole = cp.unshard_sequence(got["out"], 2, group, layout_of(method))
                close(whole, ref["out"], f"{what}: unsharded output")
                check_costs(method, work, acc, fwd, s, b, heads, d, P, r, causal, 4, what)
    # Non-contiguous shards (a (b, s, heads, d) tensor seen through a transpose).
    b, heads, sl, d = shapes(P)[0]
    q, k, v, dout = (randn(b, heads, sl * P, d, seed=200 + j) for j in range(4))
    ref = reference(q, k, v, dout, True, torch.float32)
    for method in methods_for(heads, P):
        got, *_ = parallel(method, q, k, v, dout, group, True, transposed=True)
        compare(got, ref, method, group, f"float32 {method} causal, non-contiguous shards")


def check_float64(P, r, group, ring_only=False):
    """float64 in, float64 out: the ring accumulates in the input's type when it is wider
    than float32. assert_close's float64 defaults (rtol = atol = 1e-7) would pass float32
    arithmetic too (errors ~1e-7 here), so the bound is float64's rounding: γ_n of float64
    times the magnitudes, n from :func:`roundings` doubled (float64 SDPA rounds too),
    ~1e-13 relative on these shapes."""
    for i, (b, heads, sl, d) in enumerate(shapes(P)[::3]):     # the first and the last shape
        s = sl * P
        q, k, v, dout = (randn(b, heads, s, d, seed=300 + 10 * i + j, dtype=torch.float64) for j in range(4))
        for causal in (False, True):
            ref = reference(q, k, v, dout, causal, torch.float64)
            for method in methods_for(heads, P):
                if ring_only and method == "ulysses":
                    continue
                what = f"float64 {method} causal={causal} (b, heads, s_local, d)={(b, heads, sl, d)}"
                got, work, acc, fwd = parallel(method, q, k, v, dout, group, causal)
                for key, t in got.items():
                    expect(t.dtype == torch.float64, f"{what}: {key} dtype {t.dtype}")
                compare(got, ref, method, group, what, attention_tol(torch.float64, q, k, v, dout, causal, P))
                check_costs(method, work, acc, fwd, s, b, heads, d, P, r, causal, 8, what)


def check_bfloat16(P, r, group):
    """bf16 in, bf16 out, against float32 SDPA on the same (bf16-rounded) inputs.

    bfloat16's unit roundoff is u = 2^-8 ≈ 3.9e-3 (``torch.finfo(torch.bfloat16).eps`` is
    2^-7, the gap above 1). The ring computes in float32 and rounds its output and
    gradients to bfloat16 once: u·|want| + γ_n·mag, n from :func:`roundings` doubled (the
    float32 reference rounds too), so rtol ≈ u + γ_n ≈ 4e-3 (:func:`attention_tol`).
    Ulysses runs SDPA in bfloat16: its CPU flash-attention kernel keeps scores, row maxima
    and sums in float32 but converts p (forward and backward) and dS to bfloat16 for its
    matrix products, and each such rounding moves a result by at most u times its
    magnitude: 3u·mag more (measured: at most 0.3u·mag beyond u·|want| on these shapes).
    (assert_close's bf16 defaults, rtol 1.6e-2 and atol 1e-5, are 4u relative and 1/400 of
    one rounding for entries near zero.)
    """
    for i, (b, heads, sl, d) in enumerate(shapes(P)[::3]):
        s = sl * P
        q, k, v, dout = (randn(b, heads, s, d, seed=400 + 10 * i + j, dtype=torch.bfloat16) for j in range(4))
        for causal in (False, True):
            ref = reference(q, k, v, dout, causal, torch.float32)
            for method in methods_for(heads, P):
                what = f"bfloat16 {method} causal={causal} (b, heads, s_local, d)={(b, heads, sl, d)}"
                got, work, acc, fwd = parallel(method, q, k, v, dout, group, causal)
                for key, t in got.items():
                    expect(t.dtype == torch.bfloat16, f"{what}: {key} dtype {t.dtype}")
                sdpa_roundings = 3 if method == "ulysses" else 0       # p twice and dS, in bf16
                compare(got, ref, method, group, what,
                        attention_tol(torch.bfloat16, q, k, v, dout, causal, P, extra=sdpa_roundings))
                check_costs(method, work, acc, fwd, s, b, heads, d, P, r, causal, 2, what)


def check_large_scores(P, r, group):
    """Scores of order 1e4: no overflow, and the same result as float64 SDPA.

    (a) q and k scaled up (as the chapter does): every softmax row is all but one-hot.
        Ring attention must match float64 SDPA to float32's default tolerances; Ulysses,
        which runs float32 SDPA itself, must match float32 SDPA (float32 SDPA's dq is up to
        ~2e-5 off float64 here, over float32's atol of 1e-5).
    (b) Every score offset by about 1e4 with spreads of order 1, so no row saturates. A
        float32 score q·k·scale of size σ ≈ 1e4 is the sum of d products, rounded d + 1
        times: |δs| ≤ γ_{d+1}·σ ≈ 5·6e-8·1e4 = 3e-3 (float32 SDPA itself is ~5e-4 off
        float64 here), and shifting the scores by δs moves the softmax, so the output and
        the gradients, by at most 2|δs| relative to their magnitudes: 2(d + 1)σ roundings,
        the bulk of :func:`roundings`' count (the rest is in the spread W ~ 10, not in
        σ), against float64 SDPA (whose own rounding is negligible): γ_n ≈ 6e-3 relative
        to the elementwise magnitudes of :func:`magnitudes`.
    """
    b, heads, sl, d = 1, 2, 4, 4
    s = sl * P
    q, k, v, dout = (randn(b, heads, s, d, seed=500 + j) for j in range(4))
    saturated = (q * 70, k * 70)
    qo, ko = q.clone(), k.clone()
    qo[..., 0] = ko[..., 0] = (2 * 1e4) ** 0.5                      # score offset a²/√d = 1e4
    for case, (qq, kk) in (("saturated", saturated), ("offset", (qo, ko))):
        top = float((qq.double() @ kk.double().transpose(-2, -1) / d ** 0.5).abs().max())
        expect(5e3 <= top <= 5e4, f"large scores {case}: largest score {top:.0f} is not of order 1e4")
        for causal in (False, True):
            ref = reference(qq, kk, v, dout, causal, torch.float64)
            ref32 = reference(qq, kk, v, dout, causal, torch.float32)
            for method in methods_for(heads, P):
                what = f"scores ~1e4 ({case}) {method} causal={causal}"
                got, *_ = parallel(method, qq, kk, v, dout, group, causal)
                for key, t in got.items():
                    expect(bool(torch.isfinite(t).all()), f"{what}: {key} not finite")
                if case == "saturated":   # one-hot rows: p is 0 or 1 to within e^-(gap), float32 defaults
                    compare(got, ref32 if method == "ulysses" else ref, method, group, what)
                else:
                    compare(got, ref, method, group, what,
                            attention_tol(torch.float32, qq, kk, v, dout, causal, P, both=1))


# ---------------------------------------------------------------------------- grouped-query attention

def gqa_reference(q, k, v, dout, causal):
    """SDPA on the whole sequence with k, v repeated for each group of query heads: the
    gradients of the unrepeated k, v sum over their group (autograd through repeat_interleave)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(leaves[0], *(t.repeat_interleave(g, 1) for t in leaves[1:]),
                                         is_causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def check_gqa(P, r, group):
    """k and v with fewer heads than q: every ring layout (and Ulysses where P divides the
    key/value heads) against SDPA, forward and backward; the ring moves only the kv heads."""
    for b, heads, kv, sl, d in ((2, 4, 2, 4, 4), (1, 2 * P, P, 2, 8), (1, 6, 1, 4, 2)):
        s = sl * P
        q, dout = (randn(b, heads, s, d, seed=800 + j) for j in range(2))
        k, v = (randn(b, kv, s, d, seed=810 + j) for j in range(2))
        for causal in (False, True):
            ref = gqa_reference(q, k, v, dout, causal)
            for method in METHODS:
                if method == "ulysses" and (heads % P or kv % P):
                    continue
                what = f"GQA {heads}/{kv} heads {method} causal={causal}"
                got, work, acc, fwd = parallel(method, q, k, v, dout, group, causal)
                expect(got["dk"].shape[1] == kv, f"{what}: dk has {got['dk'].shape[1]} heads, want {kv}")
                compare(got, ref, method, group, what)                      # float32 defaults
                check_costs(method, work, acc, fwd, s, b, heads, d, P, r, causal, 4, what, kv_heads=kv)


# ---------------------------------------------------------------------------- overlap of the backward

def check_backward_overlap(P, r, group):
    """The backward's dk, dv moves overlap compute: each but the last is waited for only after
    the next ring step's block computations have run (the order of events, logged here)."""
    events = []
    real_start, real_scores = cp.comm.ring_exchange_start, cp._scores

    def start(tensors, shift=1, group=None, label="", phase="forward"):
        pending = real_start(tensors, shift, group, label, phase)
        events.append(("start", label, phase))

        class Logged:
            def wait(self):
                events.append(("wait", label, phase))
                return pending.wait()
        return Logged()

    def scores(*args):
        events.append(("compute", "", ""))
        return real_scores(*args)

    q, k, v, dout = (randn(1, 2, 2 * P, 4, seed=900 + j) for j in range(4))
    cp.comm.ring_exchange_start, cp._scores = start, scores
    try:
        parallel("ring contiguous", q, k, v, dout, group, causal=False)     # every step computes
    finally:
        cp.comm.ring_exchange_start, cp._scores = real_start, real_scores
    grads = [i for i, e in enumerate(events) if e[1] == "ring dk,dv"]
    expect(len(grads) == 2 * P, f"{len(grads) // 2} dk, dv exchanges, want P = {P}: {events}")
    for n, (i, j) in enumerate(zip(grads[::2], grads[1::2])):
        expect(events[i][0] == "start" and events[j][0] == "wait", f"dk, dv exchange {n}: {events[i:j + 1]}")
        if n < P - 1:
            computed = sum(e[0] == "compute" for e in events[i:j])
            expect(computed > 0, f"dk, dv exchange {n} of {P} is waited for before any compute: serialised "
                                 f"({events[i:j + 1]})")


# ---------------------------------------------------------------------------- composed with tensor parallelism

def check_tp_cp(P, r, group):
    """intralayer.programs.cp_tp's layer (TP over heads × CP over the sequence, GQA) against the
    dense layer on every grid the world allows with t ≤ 2, ring and Ulysses: output, input and
    weight gradients, the ring's bytes (a_kv/t heads) and where each collective ran."""
    from intralayer.programs import cp_tp

    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device("cuda", torch.cuda.current_device())
    for t in (1, 2):
        if P % t:
            continue
        for method in cp_tp.METHODS:
            res = cp_tp.check_layer(device, t, P // t, method)
            expect(res["tp"] == r % t and res["cp"] == r // t, f"grid position {res['tp'], res['cp']} of rank {r}")


# ---------------------------------------------------------------------------- shard / unshard

def check_shard_unshard(P, r, group):
    n = 2 * P
    x = randn(n, 2 * n, n + n, n, seed=600)       # every dimension divisible by 2P
    for layout in cp.LAYOUTS:
        for dim in (0, 1, 2, -1):
            what = f"shard/unshard {layout} dim={dim}"
            mine = cp.shard_sequence(x, dim, group, layout)
            tokens = TOKENS[layout](r, P, x.shape[dim])
            want = x.index_select(dim, torch.tensor(tokens))
            expect(torch.equal(mine, want), f"{what}: this rank's shard is not tokens {tokens}")
            expect(mine.shape[dim % x.dim()] == x.shape[dim] // P, f"{what}: shard shape {tuple(mine.shape)}")
            expect(torch.equal(cp.unshard_sequence(mine, dim, group, layout), x), f"{what}: round trip")

            # Backward: the same loss on every rank from the unsharded tensor; each rank
            # gets the gradient of its own shard (not P times it, not another rank's).
            leaf = mine.clone().requires_grad_()
            w = randn(*x.shape, seed=601)
            whole = cp.unshard_sequence(leaf, dim, group, layout)
            (whole * w).sum().backward()
            expect(torch.equal(leaf.grad, cp.shard_sequence(w, dim, group, layout)), f"{what}: backward")
            # Second-order use: a loss that is not linear in the tensor.
            leaf = mine.clone().requires_grad_()
            full = x.clone().requires_grad_()
            (cp.unshard_sequence(leaf, dim, group, layout) ** 2 * w).sum().backward()
            (full ** 2 * w).sum().backward()
            close(leaf.grad, cp.shard_sequence(full.grad, dim, group, layout), f"{what}: backward of a square",
                  **EXACT)                                       # the same elementwise 2·x·w


# ---------------------------------------------------------------------------- bad input

def check_bad_input(P, r, group):
    q = randn(1, 4 * P, 2, 4, seed=700)
    odd = randn(1, 2 * P, 3, 4, seed=701)                      # s = 3P: not divisible by 2P
    for fn, what in ((lambda: cp.ring_attention(odd, odd, odd, group, True, "zigzag"), "ring zigzag, s = 3P"),
                     (lambda: cp.shard_sequence(randn(1, 2, 3 * P, 4, seed=702), 2, group, "zigzag"),
                      "shard zigzag, s = 3P")):
        raises(fn, f"sequence length {3 * P} is not divisible by 2P = {2 * P}", "zigzag", what=what)
    raises(lambda: cp.shard_sequence(randn(1, 2, P + 1, 4, seed=703), 2, group, "contiguous"),
           f"sequence length {P + 1} is not divisible by P = {P}", what="shard contiguous, s = P + 1")
    raises(lambda: cp.unshard_sequence(odd, 2, group, "zigzag"), "zigzag", "3 tokens do not split into 2",
           what="unshard zigzag, odd shard")

    gqa_q, gqa_kv = randn(1, 4 * P, 2, 4, seed=707), randn(1, 3, 2, 4, seed=708)      # 3 ∤ 4P
    for name, fn in (("ring", cp.ring_attention), ("ulysses", cp.ulysses_attention)):
        raises(lambda: fn(gqa_q, gqa_kv, gqa_kv, group), "same shape", "divides q's", "(1, 3, 2, 4)",
               what=f"{name}: key/value heads that do not divide the query heads")
    one_kv = randn(1, 1, 2, 4, seed=709)
    raises(lambda: cp.ulysses_attention(randn(1, 2 * P, 2, 4, seed=710), one_kv, one_kv, group),
           "kv_heads/P", f"1 key/value heads are not divisible by the context-parallel degree P={P}",
           what="Ulysses, one key/value head")
    from intralayer.programs import cp_tp
    raises(lambda: cp_tp.check_grid(8, 2, 2, P, "Ulysses", 4 * P), "kv_heads/P",
           f"1 key/value heads are not divisible by the context-parallel degree P={P}",
           what="Ulysses inside TP: a_kv/t = 1")
    raises(lambda: cp_tp.check_grid(8, 2, 4, P, "ring", 4 * P), "2 key/value heads are not divisible",
           "tensor-parallel degree t=4", what="TP over more ranks than key/value heads")

    three = randn(1, 3, 2, 4, seed=704)
    raises(lambda: cp.ulysses_attention(three, three, three, group), "Ulysses",
           f"3 heads are not divisible by the context-parallel degree P={P}", what="Ulysses, 3 heads")
    if P > 2:
        two = randn(1, 2, 2, 4, seed=705)
        raises(lambda: cp.ulysses_attention(two, two, two, group, True), "2 heads are not divisible",
               "(P > heads)", what="Ulysses, fewer heads than ranks")

    short = randn(1, 4 * P, 1, 4, seed=706)
    for name, fn in (("ring", lambda a, b_, c: cp.ring_attention(a, b_, c, group)),
                     ("ring zigzag", lambda a, b_, c: cp.ring_attention(a, b_, c, group, True, "zigzag")),
                     ("ulysses", lambda a, b_, c: cp.ulysses_attention(a, b_, c, group))):
        who = "ulysses_attention" if name == "ulysses" else "ring_attention"
        raises(lambda: fn(q, short, q), who, "same shape", what=f"{name}: k shorter than q")
        raises(lambda: fn(q, q, q[..., :2]), who, "same shape", what=f"{name}: v narrower")
        raises(lambda: fn(q, q, q.transpose(1, 2)), who, "same shape", what=f"{name}: v transposed")
        ints = torch.ones(1, 4 * P, 2, 4, dtype=torch.int64)
        raises(lambda: fn(ints, ints, ints), who, "floating-point", what=f"{name}: integer q, k, v")
        raises(lambda: fn(q, ints, q), who, "k must be a floating-point", what=f"{name}: integer k")
        raises(lambda: fn(q[0], q[0], q[0]), who, "(b, heads, s_local, d)", str(q[0].shape), what=f"{name}: 3-D")
        raises(lambda: fn(q[None], q[None], q[None]), who, "(b, heads, s_local, d)", what=f"{name}: 5-D")
        raises(lambda: fn(q, q.double(), q), who, "share dtype", what=f"{name}: float32 q, float64 k")
    raises(lambda: cp.ring_attention(q, q, q, group, layout="stripes"), "layout must be one of",
           what="ring: unknown layout")
    raises(lambda: cp.shard_sequence(q, 2, group, "zig-zag"), "layout must be one of", what="shard: unknown layout")
    raises(lambda: cp.unshard_sequence(q, 2, group, "Striped"), "layout must be one of",
           what="unshard: unknown layout")


#: Every check, in the order main runs them; each is also a test item of its own (tests.programs.checks.run_check).
CHECKS = (check_bad_input, check_float32, check_float64, check_bfloat16, check_large_scores, check_shard_unshard,
          check_gqa, check_backward_overlap, check_tp_cp)


@record
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    with distributed.setup() as d:
        P, r, group = d.world_size, d.rank, d.group
        if argv == ["float64-ring"]:
            check_float64(P, r, group, ring_only=True)
            marker = FLOAT64_RING_MARKER
        elif not argv:
            check_bad_input(P, r, group)          # first: each must raise before any rank communicates
            check_float32(P, r, group)
            check_float64(P, r, group)
            check_bfloat16(P, r, group)
            check_large_scores(P, r, group)
            check_shard_unshard(P, r, group)
            check_gqa(P, r, group)
            check_backward_overlap(P, r, group)
            check_tp_cp(P, r, group)
            marker = MARKER
        else:
            raise SystemExit(f"unknown arguments {argv}; expected none or 'float64-ring'")
        dist.barrier()
        if d.is_main:
            print(f"{marker} {P}")


if __name__ == "__main__":
    main()
