"""Chapter 09's lab and bug hunt: a tensor-parallel decode step with its KV cache; the cache under GQA.

Lab (``solutions/labs/09_inference.ipynb``), a TinyGPT (:mod:`intralayer.model`) of h = 48,
a = 12 query heads of d = 4 and a_kv key/value heads (grouped-query attention: query head j
uses key/value head ⌊j / (a/a_kv)⌋), on t ranks:

- ``tp_decode_block(x, p, cache, group)``: one pre-LayerNorm block on n new tokens ``x``
  (n, b, h) — the prompt in the prefill, one token per sequence in a decode step — from this
  rank's shard ``p`` (its a/t query heads and the key/value heads they use, fc1 by rows, fc2
  by columns, the output projection's and fc2's biases whole) and this rank's cache ``cache``
  (a dict: ``k`` and ``v`` (b, kv_r, s_max, d), ``length`` the positions filled). It stores
  the new positions' keys and values, attends each new token to every cached position up to
  its own, and returns the block's output (n, b, h), the same on every rank, with exactly two
  all-reduces of n·b·h numbers (after the output projection, after fc2) and nothing else. The
  check decodes greedily — the embedding and the LM head on every rank, every block the
  learner's; the prefill in two calls, the prompt's first 3 tokens and then its other 2 on a
  cache that holds 3, as a chunked prefill does — and compares the tokens, step by step, with
  the dense model re-running the whole sequence (token for token), each call's output with the
  dense block's, and the cache with the dense keys and values of this rank's heads. It also
  reads the matrix products: a call that runs more than its n·b new token rows through a
  matrix of the shard (alone, or fused with others into one matrix) recomputes
  earlier positions instead of reading the cache.
- ``split_kv_cache(k, v, heads, group)``: from the whole cache of one layer, (b, a_kv, s, d),
  the same on every rank (a prefill server's, say), this rank's part: the key/value heads its
  query heads use — a_kv/t consecutive heads when t ≤ a_kv, the one head ⌊r·a_kv/t⌋ when
  t > a_kv (replicated: t/a_kv ranks keep each head, chapter 02's rule) — as tensors of its
  own (2·b·max(a_kv/t, 1)·s·d·e bytes, sharing no memory with the whole cache). Checked by
  values, head by head, and by bytes; no communication. Dealing the replicated heads out round
  robin (ranks' heads 0, 1, 0, 1 instead of 0, 0, 1, 1) corrupted SGLang's prefill→decode
  transfer (sgl-project/sglang#23744, fixed by #30997).

The library's own answers (:mod:`intralayer.inference`, :mod:`intralayer.serving`,
:mod:`intralayer.tensor_parallel`) are refused while the learner's code runs.

Bug hunt: ``gather_kv_cache(k, v, kv_heads, group)`` assembles the whole cache (b, a_kv, s, d)
on every rank from the ranks' parts (as a decode server with attention TP 1 receives it from
a prefill server at TP t). Both bugs are the two halves of the root cause that
sgl-project/sglang#19086 gives for SGLang's prefill→decode KV transfer with replicated heads
(Qwen3.5, 2 key/value heads, prefilled at attention TP 4): the transfer back-computed the
total heads as heads per rank × TP ("computed total = 1 * 4 = 4 (wrong, actual = 2)") and
wrote each prefill rank's heads at offsets computed as if no head were replicated; the fix
carries the total head count explicitly and adds a replication factor (``src_replication``)
to the mapping; SGLang later shared one head-slice helper across its mooncake, mori and nixl
backends (sgl-project/sglang#39660). ``no_replicas``: head h taken from rank ⌊h / (heads per rank)⌋,
right while t ≤ a_kv, wrong heads once t > a_kv. ``counted_heads``: the whole cache's heads
counted as heads per rank × t, every replicated head once per rank that keeps it. (The
course's rewrite of the logic, not SGLang's code.) The product came up again in vllm-ascend's
Mooncake connector, which read the rank-local KV-head count as the model's
(vllm-project/vllm-ascend#11885): a reviewer of the fix, #11886, objected to its first
draft's local heads × TP ("8 global heads with TP 16 yields 16"), and the merged fix carries
each transfer group's total explicitly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..model import TinyGPT
from .common import differ, group_info, traffic
from .parts import Implementation, Param, hunt, lab
from .runner import Mode, watch

#: float64: the longest sums are fc2's 96-term rows and the attention's ≤ 10 positions; their
#: rounding stays near 2γ_96·Σ|terms| ≈ 1e-13 (terms of order 1), so 1e-10 is a wide margin far
#: below any wrong answer (a missing bias, a head of another group, an unmasked position: ~1e-2).
TOL = dict(rtol=1e-10, atol=1e-10)
V_, H_, A_, D_, FFN_, L_ = 40, 48, 12, 4, 96, 2     # vocabulary, h, heads a (t = 2, 3, 4 divide it), d, MLP f, L
B_, PROMPT_, STEPS_ = 2, 5, 6                         # sequences, prompt tokens, tokens decoded
CHUNK_ = 3                                            # the prefill's first call: 3 tokens, then the other 2
S_ = 7                                                # positions of part 2's cache
KV_CHOICES = (12, 6, 4, 3, 2, 1)                      # key/value heads a_kv (each divides a = 12)
PARAMS = {"kv_heads": Param(4, KV_CHOICES), "seed": Param(0, minimum=0)}
FORBID = ("intralayer.inference", "intralayer.serving", "intralayer.tensor_parallel")
WHY = ("intralayer.inference, intralayer.serving and intralayer.tensor_parallel hold the library's own cached "
       "decoding and head split, the answers to this lab: write them from slices, matmuls and dist.all_reduce")


def _check_case(t: int, kv: int) -> None:
    if kv % t and t % kv:
        raise ValueError(f"a case with t = {t} and a_kv = {kv}: one must divide the other (chapter 02's rule)")


def kv_heads_of(r: int, t: int, kv: int) -> list[int]:
    """The key/value heads rank r of t keeps: those its query heads r·a/t … (r+1)·a/t − 1 use."""
    return sorted({j // (A_ // kv) for j in range(r * A_ // t, (r + 1) * A_ // t)})


def dense_model(seed: int, kv: int) -> TinyGPT:
    """The dense TinyGPT in float64, the same on every rank, its LayerNorms and biases random too."""
    torch.manual_seed(seed)
    model = TinyGPT(V_, H_, A_, layers=L_, ffn=FFN_, kv_heads=kv).double().eval()
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln" in name or name.startswith("ln"):
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        model.embed.weight.mul_(2.0)
    return model


def shard(block, t: int, r: int, kv: int) -> dict:
    """Rank r's part of a dense block, as the check hands it to the learner."""
    a_r, heads = A_ // t, kv_heads_of(r, t, kv)
    qkv_w, qkv_b = block.attn.qkv.weight.detach(), block.attn.qkv.bias.detach()
    q = slice(r * a_r * D_, (r + 1) * a_r * D_)
    kv_rows = torch.cat([torch.arange(h * D_, (h + 1) * D_) for h in heads])
    k_rows, v_rows = H_ + kv_rows, H_ + kv * D_ + kv_rows
    f = FFN_ // t
    rows = slice(r * f, (r + 1) * f)
    mlp = block.mlp
    return {"ln1": block.ln1, "wq": qkv_w[q].clone(), "bq": qkv_b[q].clone(),
            "wk": qkv_w[k_rows].clone(), "bk": qkv_b[k_rows].clone(),
            "wv": qkv_w[v_rows].clone(), "bv": qkv_b[v_rows].clone(),
            "wo": block.attn.proj.weight.detach()[:, q].clone(), "bo": block.attn.proj.bias.detach().clone(),
            "ln2": block.ln2, "w1": mlp.fc1.weight.detach()[rows].clone(), "b1": mlp.fc1.bias.detach()[rows].clone(),
            "w2": mlp.fc2.weight.detach()[:, rows].clone(), "b2": mlp.fc2.bias.detach().clone()}


def prompt_of(seed: int) -> torch.Tensor:
    return torch.randint(0, V_, (PROMPT_, B_), generator=torch.Generator().manual_seed(7 + seed))


@torch.no_grad()
def dense_tokens(model: TinyGPT, prompt: torch.Tensor) -> list[torch.Tensor]:
    """Greedy decoding without a cache: the whole sequence through the dense model at every step."""
    ids, out = prompt, []
    for _ in range(STEPS_):
        token = model(ids)[-1].argmax(-1)                            # (b,)
        out.append(token)
        ids = torch.cat([ids, token[None]])
    return out


def everyone(ok: bool, group) -> bool:
    """Whether ``ok`` holds on every rank of the group (so that all ranks stop, or go on, together)."""
    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _kv_of(block, x: torch.Tensor, kv: int, heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense block's keys and values of ``heads`` for the inputs x (s, b, h): (b, len(heads), s, d) each."""
    s, b = x.shape[:2]
    qkv = block.attn.qkv(block.ln1(x))                              # (s, b, h + 2·kv·d)
    k = qkv[..., H_:H_ + kv * D_].reshape(s, b, kv, D_).permute(1, 2, 0, 3)
    v = qkv[..., H_ + kv * D_:].reshape(s, b, kv, D_).permute(1, 2, 0, 3)
    return k[:, heads], v[:, heads]


def _output_words(y, want, n: int, t: int, b2, phase: str, decode_ok: bool, second_chunk: bool = False) -> str:
    """Why a call's output is wrong, when the difference has a recognisable shape (``decode_ok``: every
    earlier call was right)."""
    if not (isinstance(y, torch.Tensor) and y.shape == want.shape and y.dtype == want.dtype):
        return ""
    off = (y - want).abs().amax(dim=(1, 2))                         # (n,): per position
    if torch.allclose(y - want, ((t - 1) * b2).expand_as(want), **TOL):
        return f"; it holds {t} times fc2's bias: add b2 once, after the all-reduce"
    if second_chunk and decode_ok:
        return ("; the prefill's first chunk was right but its second is not: new token i of a call is at position "
                "length + i and attends to every cached position and to the new ones up to its own — a causal mask "
                "aligned to the top left (scaled_dot_product_attention's is_causal=True when the keys outnumber the "
                "queries, or triu over the new tokens alone) hides cached positions from it")
    if phase == "prefill" and n > 1 and float(off[-1]) < 1e-9 and float(off[:-1].max()) > 1e-9:
        return ("; only the prompt's last position is right: within the prefill, new token i (at position "
                "length + i) sees the cached positions and the new ones up to its own, not the later ones — "
                "mask them")
    if phase != "prefill" and decode_ok:
        return ("; the prefill was right but this decode step is not: the new token attends to every cached "
                "position 0 … length, its own included, in this rank's cache")
    return ""


#: The shard's matrices a token goes through once, by the names the learner sees.
_MATRICES = {"wq": "query", "wk": "key", "wv": "value", "wo": "output", "w1": "fc1", "w2": "fc2"}
_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm"}


class _Rows(Mode):
    """The most token rows the learner's code ran through each of the shard's matrices in one call, found in
    torch's matrix products by the matrix (its storage, or equal values, transposed or not, alone or as a block of
    rows of a fused matrix) and summed over the products with the same rows of it (a product a position, or a
    head a product, counts right): a KV cache exists so that a step runs only its new tokens through the
    projections."""

    def __init__(self, shard: dict):
        super().__init__()
        self.weights = {name: shard[name] for name in _MATRICES}
        self.ptrs = {w.untyped_storage().data_ptr(): name for name, w in self.weights.items()}
        self.rows: dict[str, int] = {}
        self.summed: dict[tuple, int] = {}

    def _which(self, t: torch.Tensor) -> tuple[str, tuple] | None:
        """(the matrix's name, which rows of it) for a product's operand that is one of the shard's matrices."""
        if t.untyped_storage().data_ptr() in self.ptrs:
            return self.ptrs[t.untyped_storage().data_ptr()], (t.storage_offset(), tuple(sorted(t.shape)))
        flat = t.reshape(t.shape[-2:]) if t.dim() == 3 and t.shape[0] == 1 else t
        if flat.dim() != 2:
            return None
        for name, w in self.weights.items():          # w itself, or a block of rows of a fused matrix (q, k, v)
            for m in (flat, flat.T):
                if m.dtype == w.dtype and m.shape[1] == w.shape[1] and m.shape[0] >= w.shape[0] and \
                        any(torch.equal(m[o:o + w.shape[0]], w) for o in range(m.shape[0] - w.shape[0] + 1)):
                    return name, (0, tuple(sorted(w.shape)))
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _PRODUCTS:
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2][-2:]
            if len(mats) == 2:
                for mine, other in ((mats[0], mats[1]), (mats[1], mats[0])):
                    found = self._which(mine)
                    if found is not None and self._which(other) is None:
                        name = found[0]
                        self.summed[found] = self.summed.get(found, 0) + other.numel() // self.weights[name].shape[1]
                        self.rows[name] = max(self.rows.get(name, 0), self.summed[found])
                        break
        return func(*args, **(kwargs or {}))


def _recompute_problem(rows: dict, n: int, phase: str) -> str | None:
    """Words when a call ran more than its n·b new token rows through a matrix of the shard."""
    over = {name: r for name, r in rows.items() if r > n * B_}
    if not over:
        return None
    name, r = max(over.items(), key=lambda item: item[1])
    return (f"{phase} ran {r} token rows through this rank's {_MATRICES[name]} matrix ({name}), for n·b = {n}·{B_} "
            f"= {n * B_} new ones: it recomputes earlier positions instead of reading them from the cache — a step "
            "projects only its new tokens, and the earlier keys and values come from cache['k'] and cache['v']")


def _comm_problems(calls, n: int, phase: str) -> list[tuple[str, str]]:
    """(kind, words) of each problem unless ``calls`` are exactly two SUM all-reduces of the n·b·h activation."""
    elements = n * B_ * H_
    ars = [c for c in calls if c.op == "all_reduce"]
    others = [c for c in calls if c.op != "all_reduce"]
    problems = []
    if others:
        problems.append(("others", f"{phase} also sent {traffic(others)}: tensor parallelism moves nothing but two "
                                   "all-reduces of the activation per block — the weights and the cache stay on "
                                   "their rank"))
    if len(ars) != 2 or any(c.elements != elements or c.reduce != "SUM" for c in ars):
        said = traffic(ars) if ars else "no all-reduce"
        problems.append(("count", f"{phase} sent {said}; a block needs exactly two all-reduces (sums) of n·b·h = "
                                  f"{n}·{B_}·{H_} = {elements} numbers: one of the attention's partial outputs "
                                  "after its output projection, one of the MLP's after fc2"))
    return problems


def _summary_decode(facts: dict) -> str:
    plural = "s" if facts["kv_r"] > 1 else ""
    return (f"{facts['t']} ranks, a_kv = {facts['kv']} ({facts['kv_r']} key/value head{plural} "
            f"and {A_ // facts['t']} query heads per rank): {STEPS_} tokens per sequence equal the dense model's, "
            f"token for token; every call two all-reduces of n·b·h numbers ({facts['prefill']} in the prefill, "
            f"{B_ * H_} in a decode step); each rank's cache holds {facts['cache']} bytes, 2·L·max(a_kv/t, 1)·d·e "
            f"per token for b·(prompt + decoded − 1) = {B_}·{PROMPT_ + STEPS_ - 1} tokens")


@lab("tp_decode_block", ("tp_decode_block",), params=PARAMS, forbid_modules=FORBID, why=WHY, summary=_summary_decode)
def check_decode(ns, case, group) -> dict:
    t, me = group_info(group)
    kv = case["kv_heads"]
    _check_case(t, kv)
    model = dense_model(case["seed"], kv)
    prompt = prompt_of(case["seed"])
    want_tokens = dense_tokens(model, prompt)
    heads, s_max = kv_heads_of(me, t, kv), PROMPT_ + STEPS_ - 1
    shards = [shard(block, t, me, kv) for block in model.blocks]
    caches = [{"k": torch.zeros(B_, len(heads), s_max, D_, dtype=torch.float64),
               "v": torch.zeros(B_, len(heads), s_max, D_, dtype=torch.float64), "length": 0} for _ in model.blocks]
    buffers = [(c["k"], c["v"]) for c in caches]                   # the preallocated s_max positions
    seen = [[] for _ in model.blocks]                              # each block's inputs so far, (n, b, h) each
    problems, said, tokens, prefill_ok = [], set(), [], True

    def once(kind: str, words: str) -> None:
        if kind not in said:
            said.add(kind)
            problems.append(words)

    with torch.no_grad():
        chunks = [model.embed(prompt[:CHUNK_]), model.embed(prompt[CHUNK_:])]   # the prefill, in two calls
        stopped = False
        for step in range(-1, STEPS_):
            phase = ("the prefill's first chunk", "the prefill's second chunk")[step + 1] if step < 1 else \
                f"decode step {step}"
            x = chunks[step + 1] if step < 1 else x
            n = x.shape[0]
            for layer, block in enumerate(model.blocks):
                seen[layer].append(x)
                x_all = torch.cat(seen[layer])                      # (length + n, b, h)
                want = block(x_all)[-n:]                            # causal: the dense block's rows of the new tokens
                with watch() as calls, _Rows(shards[layer]) as rows:
                    y = ns.tp_decode_block(x.clone(), shards[layer], caches[layer], group)
                ok = isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(x.shape) and y.dtype == x.dtype
                if not ok:
                    got = f"shape {tuple(y.shape)} and dtype {y.dtype}" if isinstance(y, torch.Tensor) \
                        else f"a {type(y).__name__}"
                    once("shape", f"{phase} of block {layer} returned {got}; it should return the block's output for "
                                  f"the new tokens, (n, b, h) = {tuple(x.shape)} in {x.dtype}, the same on every rank")
                if not everyone(ok, group):
                    stopped = True
                    break
                wrong = differ(y, want, f"{phase}'s output of block {layer}", **TOL)
                if wrong:
                    earlier_ok, prefill_ok = prefill_ok, prefill_ok and step > 0
                    once("output", wrong + _output_words(y, want, n, t, block.mlp.fc2.bias, "prefill"
                                                         if step < 1 else "decode", earlier_ok, step == 0))
                for kind, words in _comm_problems(calls, n, f"{phase} (block {layer})"):
                    once(kind, words)
                if words := _recompute_problem(rows.rows, n, f"{phase} (block {layer})"):
                    once("recompute", words)
                cache = caches[layer]
                length = len(x_all)
                if any(cache.get(name) is not buffer for name, buffer in zip("kv", buffers[layer])):
                    once("buffer", f"after {phase} block {layer}'s cache['k'] or cache['v'] is a new tensor: store the "
                                   "new keys and values in the buffers the cache came with (cache['k'][:, :, length:"
                                   "length + n] = ...), which hold s_max positions so that a step copies nothing else")
                if cache.get("length") != length:
                    once("length", f"after {phase} block {layer}'s cache['length'] is {cache.get('length')!r}; it "
                                   f"should be {length}, the positions cached so far (the prompt's first {CHUNK_} "
                                   f"tokens, then all {PROMPT_}, then one more per decode step): set it after storing "
                                   "the new keys and values")
                else:
                    k_want, v_want = _kv_of(block, x_all, kv, heads)
                    for name, want_c in (("k", k_want), ("v", v_want)):
                        got_c = cache.get(name)
                        got_c = got_c[:, :, :length] if isinstance(got_c, torch.Tensor) else got_c
                        bad = differ(got_c, want_c, f"block {layer}'s cache['{name}'][:, :, :{length}] after {phase}",
                                     **TOL)
                        if bad:
                            once("cache", bad + f"; it should hold the {'keys' if name == 'k' else 'values'} of this "
                                                f"rank's key/value heads {heads} at positions 0 … {length - 1}, "
                                                "position by position")
                x = y.detach()
            if stopped:
                break
            if step < 0:                                            # the prompt's first chunk: no token yet
                continue
            token = model.head(model.ln_f(x))[-1].argmax(-1)        # (b,): the LM head on every rank
            tokens.append(token)
            x = model.embed(token[None])                            # (1, b, h): the next decode step's input
        if not stopped and not problems:
            got, want = torch.stack(tokens), torch.stack(want_tokens)
            if not torch.equal(got, want):
                step = int(torch.nonzero((got != want).any(-1))[0])
                problems.append(f"the decoded tokens differ from the dense model's from step {step}: got "
                                f"{got.T.tolist()}, the dense model decodes {want.T.tolist()}")
    cache_bytes = sum(c["k"].nbytes + c["v"].nbytes for c in caches if isinstance(c.get("k"), torch.Tensor)
                      and isinstance(c.get("v"), torch.Tensor))
    return {"problems": problems, "facts": {"t": t, "kv": kv, "kv_r": len(heads), "prefill": PROMPT_ * B_ * H_,
                                            "cache": cache_bytes}}


# ---------------------------------------------------------------------------- part 2: the cache under GQA

def _which_heads(got: torch.Tensor, whole: torch.Tensor) -> list:
    """For each head of ``got`` (b, m, s, d), the head of ``whole`` it equals (None for none)."""
    return [next((i for i in range(whole.shape[1]) if torch.equal(got[:, j], whole[:, i])), None)
            for j in range(got.shape[1])]


def _summary_split(facts: dict) -> str:
    shared = (f"; each head kept by t/a_kv = {facts['t'] // facts['kv']} ranks (ranks' heads {facts['mapping']})"
              if facts["t"] > facts["kv"] else f"; ranks' heads {facts['mapping']}")
    return (f"{facts['t']} ranks, a = {A_} query heads, a_kv = {facts['kv']}: each rank keeps {facts['m']} key/value "
            f"head{'s' if facts['m'] > 1 else ''}, {facts['bytes']} of the whole cache's {facts['whole']} bytes "
            f"(2·b·max(a_kv/t, 1)·s·d·e){shared}")


@lab("split_kv_cache", ("split_kv_cache",), params=PARAMS, forbid_modules=FORBID, why=WHY, summary=_summary_split)
def check_split(ns, case, group) -> dict:
    t, me = group_info(group)
    kv = case["kv_heads"]
    _check_case(t, kv)
    g = torch.Generator().manual_seed(1000 * case["seed"] + 10 * t + kv)
    K, V = (torch.randn(B_, kv, S_, D_, generator=g, dtype=torch.float64) for _ in range(2))
    k_in, v_in = K.clone(), V.clone()
    with watch() as calls:
        out = ns.split_kv_cache(k_in, v_in, A_, group)
    problems = []
    if calls:
        problems.append(f"split_kv_cache sent {traffic(calls)}; every rank already holds the whole cache: keeping "
                        "its part is slicing, no communication")
    if not (isinstance(out, tuple) and len(out) == 2):
        what = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        return {"problems": problems + [f"split_kv_cache returned {what}; it should return (k, v), this rank's keys "
                                        "and values"], "facts": {}}
    heads, m = kv_heads_of(me, t, kv), max(kv // t, 1)
    rule = (f"with t = {t} ≤ a_kv = {kv} a rank keeps a_kv/t = {m} consecutive heads" if t <= kv else
            f"with t = {t} > a_kv = {kv} a rank keeps one head, ⌊r·a_kv/t⌋, the one its query heads use (t/a_kv = "
            f"{t // kv} ranks keep each head)")
    for got, whole, given, name in ((out[0], K, k_in, "k"), (out[1], V, v_in, "v")):
        want = whole[:, heads]
        wrong = differ(got, want, f"this rank's {name}")
        if wrong:
            if isinstance(got, torch.Tensor) and got.dim() == 4 and got.shape[0] == B_ \
                    and got.shape[2:] == want.shape[2:] and got.dtype == want.dtype:
                held = _which_heads(got, whole)
                other = next((q for q in range(t) if q != me and held == kv_heads_of(q, t, kv)), None)
                whose = f", group rank {other}'s part" if other is not None else ""
                wrong += (f"; it holds key/value heads {held}{whose}; group rank {me}'s query heads {me * A_ // t} … "
                          f"{(me + 1) * A_ // t - 1} use key/value heads {heads} (query head j uses head "
                          f"⌊j / (a/a_kv)⌋ = ⌊j / {A_ // kv}⌋): {rule}")
            else:
                wrong += f"; {rule}"
            problems.append(wrong)
            continue
        kept = got.untyped_storage().nbytes()
        if got.untyped_storage().data_ptr() == given.untyped_storage().data_ptr() and kept > got.nbytes:
            problems.append(f"this rank's {name} shares memory with the whole cache it was cut from (a view: "
                            f"{kept} bytes kept alive for its {got.nbytes}): copy this rank's heads (.clone()) so "
                            "that the rest can be freed — the point of splitting the cache")
        elif kept != got.nbytes:
            problems.append(f"this rank's {name} is a view into a buffer of {kept} bytes, for its {got.nbytes}: keep "
                            "only this rank's heads, in a tensor of their own (.contiguous() or .clone() of the slice)")
    e = K.element_size()
    return {"problems": problems, "facts": {"t": t, "kv": kv, "m": m, "bytes": 2 * B_ * m * S_ * D_ * e,
                                            "whole": 2 * K.numel() * e,
                                            "mapping": [kv_heads_of(q, t, kv) for q in range(t)]}}


# ---------------------------------------------------------------------------- bug hunt: a replicated cache, gathered

def _gathered(part: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's part, in group-rank order."""
    every = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, part.contiguous(), group=group)
    return every


def gather_kv_cache(k, v, kv_heads, group):
    """Whole-cache assembly from the ranks' parts, each head taken from a rank that keeps it."""
    t = dist.get_world_size(group)
    n = k.shape[1]                                  # heads per rank: max(a_kv/t, 1)
    copies = max(t // kv_heads, 1)                  # ranks that keep each head (t > a_kv: replicas)
    out = []
    for part in (k, v):
        every = _gathered(part, group)
        out.append(torch.stack([every[h // n * copies][:, h % n] for h in range(kv_heads)], dim=1))
    return tuple(out)                               # (b, a_kv, s, d) each


def gather_kv_cache_no_replicas(k, v, kv_heads, group):
    """Whole-cache assembly from the ranks' parts, head h taken from rank h // (heads per rank)."""
    n = k.shape[1]                                  # heads per rank: max(a_kv/t, 1)
    out = []
    for part in (k, v):
        every = _gathered(part, group)
        out.append(torch.stack([every[h // n][:, h % n] for h in range(kv_heads)], dim=1))
    return tuple(out)                               # (b, a_kv, s, d) each


def gather_kv_cache_counted_heads(k, v, kv_heads, group):
    """Whole-cache assembly from the ranks' parts, its heads counted as heads per rank × t."""
    t = dist.get_world_size(group)
    n = k.shape[1]                                  # heads per rank: max(a_kv/t, 1)
    total = n * t                                   # every rank's heads, counted once per rank
    out = []
    for part in (k, v):
        every = _gathered(part, group)
        out.append(torch.stack([every[h // n][:, h % n] for h in range(total)], dim=1))
    return tuple(out)                               # (b, total, s, d) each


def gather_kv_cache_half_fixed(k, v, kv_heads, group):
    """Whole-cache assembly from the ranks' parts, the keys' heads taken from ranks that keep them, the values' from
    rank h // (heads per rank)."""
    t = dist.get_world_size(group)
    n = k.shape[1]                                  # heads per rank: max(a_kv/t, 1)
    keys, values = _gathered(k, group), _gathered(v, group)
    return (torch.stack([keys[h // n * max(t // kv_heads, 1)][:, h % n] for h in range(kv_heads)], dim=1),
            torch.stack([values[h // n][:, h % n] for h in range(kv_heads)], dim=1))   # the fix made to one of two


hunt("replicated_kv_gather", "test_gather_kv_cache", {
    "no_replicas": Implementation(gather_kv_cache_no_replicas, True, "sgl-project/sglang#19086"),
    "correct": Implementation(gather_kv_cache, False),
    "counted_heads": Implementation(gather_kv_cache_counted_heads, True, "sgl-project/sglang#19086"),
    "half_fixed": Implementation(gather_kv_cache_half_fixed, True),
}, hint="both bugs need a key/value head that more than one rank keeps (t > a_kv), and one of them at least two such "
        "heads (on 4 ranks, a_kv = 2): cut every rank's part from one whole cache by the rule of part 2, for several "
        "a_kv, and compare the assembled cache with the whole one — its shape and every head")
