"""Plausible wrong answers to solutions/08_planner.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

SMALLEST = '''
def smallest_tp(model, cluster, gpus, pp, seq_len, recompute="none"):
    {check}
    c = {cluster}
    for t in {degrees}:
        if gpus % (t * pp):
            continue
        try:
            pl = planner.plan(model, c, tp=t, sp={sp}, pp=pp, dp={dp}, seq_len=seq_len,
                              recompute={recompute}, zero={zero}, global_batch=gpus)
        except ValueError:
            continue
        if pl.fits:
            return {result}
    return None
'''
SMALLEST_RIGHT = dict(check='''if gpus % pp:
        raise ValueError(f"{gpus} GPUs do not split into {pp} stages")''', cluster="dataclasses.replace(cluster, gpus=gpus)",
                      degrees="(1, 2, 4, 8)", sp="t > 1", dp="gpus // (t * pp)", recompute="recompute", zero="1",
                      result="t")


def smallest(**wrong):
    fields = {**SMALLEST_RIGHT, **wrong}
    out = SMALLEST
    for key, value in fields.items():
        out = out.replace("{" + key + "}", value)
    return out


BEST = '''
def best_layout(model, cluster, candidates, seq_len, global_batch):
    best, best_time = None, None
    for cand in candidates:
        try:
            pl = planner.plan(model, cluster, {args})
        except {errors}:
            continue
        if {ok} and (best_time is None or {score} {better} best_time):
            best, best_time = {keep}, {score}
    return best
'''
BEST_RIGHT = dict(args='sp=cand.get("tp", 1) > 1, seq_len=seq_len, zero=1, global_batch=global_batch, **cand',
                  errors="ValueError", ok="pl.fits", score="pl.time.total", better="<", keep="cand")


def best(**wrong):
    return BEST.format(**{**BEST_RIGHT, **wrong})


RATIO = '''
def flops_per_tp_byte(model):
    flops = {flops}
    return flops / ({bytes})
'''
RATIO_RIGHT = dict(flops='6 * planner.params(model)["active"] / model.layers', bytes="4 * 2 * model.hidden * 2")


def ratio(**wrong):
    return RATIO.format(**{**RATIO_RIGHT, **wrong})


VPP = '''
def vpp_to_explain(run, tolerance):
    per_stage = run.model.layers // run.layout["pp"]
    for vpp in range(1, {last}):
        if {skip}:
            continue
        pl = planner.plan({plan_args})
        if {within}:
            return vpp
    return None
'''
VPP_RIGHT = dict(last="per_stage + 1", skip="per_stage % vpp", plan_args="run.model, run.cluster, **dict(run.layout, vpp=vpp)",
                 within="abs(pl.mfu / run.published - 1) <= tolerance")


def vpp(**wrong):
    return VPP.format(**{**VPP_RIGHT, **wrong})


NEEDED = '''
def attention_efficiency_needed(run):
    def mfu(a):
        return planner.plan({plan_args}).mfu
    {none}
    lo, hi = 1e-6, 1.0
    while hi - lo > {precision}:
        mid = (lo + hi) / 2
        lo, hi = {step}
    return {result}
'''
NEEDED_RIGHT = dict(plan_args="run.model, run.cluster, attention_efficiency=a, **run.layout",
                    none='''if mfu(1.0) < run.published:
        return None''', precision="1e-5", step="(lo, mid) if mfu(mid) > run.published else (mid, hi)",
                    result="(lo + hi) / 2")


def needed(**wrong):
    fields = {**NEEDED_RIGHT, **wrong}
    out = NEEDED
    for key, value in fields.items():
        out = out.replace("{" + key + "}", value)
    return out


WRONG = {
    "smallest_tp": [
        ("visible", "no sequence parallelism", smallest(sp="False")),
        ("visible", "sequence parallelism at t = 1 too, which the planner refuses", smallest(sp="True")),
        ("visible", "no ZeRO-1: every replica keeps all the optimizer states", smallest(zero="0")),
        ("visible", "ignores the recompute argument", smallest(recompute='"none"')),
        ("visible", "the largest t that fits, not the smallest", smallest(degrees="(8, 4, 2, 1)")),
        ("visible", "dp = gpus / t, forgetting the pipeline stages", smallest(dp="gpus // t")),
        ("visible", "the whole 1024-GPU cluster, not cut to gpus", smallest(cluster="cluster")),
        ("visible", "returns the plan, not the degree", smallest(result="pl")),
        ("visible", "no ValueError when gpus does not split into pp stages", smallest(check="pass")),
        ("visible", "lets the planner's ValueError for an invalid degree through", '''
def smallest_tp(model, cluster, gpus, pp, seq_len, recompute="none"):
    if gpus % pp:
        raise ValueError(f"{gpus} GPUs do not split into {pp} stages")
    c = dataclasses.replace(cluster, gpus=gpus)
    for t in (1, 2, 4, 8):
        pl = planner.plan(model, c, tp=t, sp=t > 1, pp=pp, dp=gpus // (t * pp), seq_len=seq_len,
                          recompute=recompute, zero=1, global_batch=gpus)
        if pl.fits:
            return t
    return None
'''),
        ("visible", "the largest t tried when nothing fits, instead of None", '''
def smallest_tp(model, cluster, gpus, pp, seq_len, recompute="none"):
    if gpus % pp:
        raise ValueError(f"{gpus} GPUs do not split into {pp} stages")
    c = dataclasses.replace(cluster, gpus=gpus)
    t = 8
    for t in (1, 2, 4, 8):
        if gpus % (t * pp):
            continue
        try:
            if planner.plan(model, c, tp=t, sp=t > 1, pp=pp, dp=gpus // (t * pp), seq_len=seq_len,
                            recompute=recompute, zero=1, global_batch=gpus).fits:
                return t
        except ValueError:
            continue
    return t
'''),
    ],
    "best_layout": [
        ("visible", "ignores whether the layout fits", best(ok="True")),
        ("visible", "the slowest layout", best(better=">")),
        ("visible", "lets the planner's ValueError for an invalid layout through", best(errors="ZeroDivisionError")),
        ("visible", "the highest MFU, not the shortest step", best(score="-pl.mfu")),
        ("visible", "no global batch: the planner's default number of micro-batches",
         best(args='sp=cand.get("tp", 1) > 1, seq_len=seq_len, zero=1, **cand')),
        ("visible", "reads cand['cp'], which a candidate may leave out",
         best(args='tp=cand["tp"], sp=cand["tp"] > 1, cp=cand["cp"], pp=cand["pp"], dp=cand["dp"], ep=cand.get("ep", 1), '
                   'seq_len=seq_len, zero=1, global_batch=global_batch')),
        ("visible", "drops the expert-parallel degree",
         best(args='tp=cand["tp"], sp=cand["tp"] > 1, cp=cand.get("cp", 1), pp=cand["pp"], dp=cand["dp"], '
                   'seq_len=seq_len, zero=1, global_batch=global_batch')),
        ("visible", "no ZeRO-1", best(args='sp=cand.get("tp", 1) > 1, seq_len=seq_len, global_batch=global_batch, **cand')),
        ("visible", "returns the plan, not the candidate", best(keep="pl")),
        ("visible", "sequence parallelism for every candidate, which the planner refuses at tp = 1",
         best(args='sp=True, seq_len=seq_len, zero=1, global_batch=global_batch, **cand')),
    ],
    "flops_per_byte": [
        ("visible", "total parameters, not the active ones", ratio(flops='6 * planner.params(model)["total"] / model.layers')),
        ("visible", "forgets the factor 6", ratio(flops='planner.params(model)["active"] / model.layers')),
        ("visible", "forward FLOPs only (2 per parameter)", ratio(flops='2 * planner.params(model)["active"] / model.layers')),
        ("visible", "forgets the 2 bytes of a bf16 number", ratio(bytes="4 * 2 * model.hidden")),
        ("visible", "forgets the bus factor", ratio(bytes="4 * model.hidden * 2")),
        ("visible", "the whole model's FLOPs, not one layer's", ratio(flops='6 * planner.params(model)["active"]')),
        ("visible", "the planner's flops_per_token, which adds attention's products",
         ratio(flops='planner.flops_per_token(model, 4096)["model"] / model.layers')),
        ("visible", "the MLP width in place of the hidden size", ratio(bytes="4 * 2 * model.ffn * 2")),
    ],
    "vpp_to_explain": [
        ("visible", "tries every number of virtual stages, not only divisors", vpp(skip="False")),
        ("visible", "leaves out the largest divisor, the layers per stage themselves", vpp(last="per_stage")),
        ("visible", "the signed residual: a prediction short by any amount counts",
         vpp(within="pl.mfu / run.published - 1 <= tolerance")),
        ("visible", "the run's own residual for every vpp", vpp(within="abs(run.residual()) <= tolerance")),
        ("visible", "divisors of all the layers, not of the layers per stage",
         vpp(last="run.model.layers + 1", skip="run.model.layers % vpp")),
        ("visible", "the layout dropped: only vpp passed to the planner", vpp(plan_args="run.model, run.cluster, vpp=vpp")),
        ("visible", "the vpp with the smallest miss, not the smallest within tolerance", '''
def vpp_to_explain(run, tolerance):
    per_stage = run.model.layers // run.layout["pp"]
    miss = {}
    for v in range(1, per_stage + 1):
        if per_stage % v == 0:
            miss[v] = abs(planner.plan(run.model, run.cluster, **dict(run.layout, vpp=v)).mfu / run.published - 1)
    v = min(miss, key=miss.get)
    return v if miss[v] <= tolerance else None
'''),
        ("hidden", "a table of the visible check's answers", '''
def vpp_to_explain(run, tolerance):
    return {"Megatron-Core 177B": 4, "Megatron-Core 462B": 7}.get(run.name)
'''),
    ],
    "attention_needed": [
        ("visible", "bisects the wrong way: as if MFU fell with the efficiency",
         needed(step="(mid, hi) if mfu(mid) > run.published else (lo, mid)")),
        ("visible", "no None case", needed(none="pass")),
        ("visible", "sets every kernel's efficiency, not attention's",
         needed(plan_args="run.model, run.cluster, efficiency=a, **run.layout")),
        ("visible", "stops at a precision of 0.01", needed(precision="1e-2")),
        ("visible", "the layout dropped", needed(plan_args="run.model, run.cluster, attention_efficiency=a")),
        ("visible", "returns the MFU at the end, not the efficiency", needed(result="mfu((lo + hi) / 2)")),
        ("visible", "a grid from 0, an efficiency the planner refuses", '''
def attention_efficiency_needed(run):
    for i in range(0, 1001):
        a = i / 1000
        if planner.plan(run.model, run.cluster, attention_efficiency=a, **run.layout).mfu >= run.published:
            return a
    return None
'''),
        ("visible", "a grid in steps of 0.01", '''
def attention_efficiency_needed(run):
    for i in range(1, 101):
        a = i / 100
        if planner.plan(run.model, run.cluster, attention_efficiency=a, **run.layout).mfu >= run.published:
            return a
    return None
'''),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "smallest_tp": [("a generator over the valid degrees", '''
def smallest_tp(model, cluster, gpus, pp, seq_len, recompute="none"):
    p = planner
    if gpus % pp != 0:
        raise ValueError(f"pp = {pp} does not divide {gpus} GPUs")
    def fits(t):
        try:
            return p.plan(model, dataclasses.replace(cluster, gpus=gpus), tp=t, sp=t != 1, pp=pp, dp=gpus // pp // t,
                          seq_len=seq_len, recompute=recompute, zero=1, global_batch=gpus).fits
        except ValueError:
            return False
    return next((t for t in (1, 2, 4, 8) if (gpus // pp) % t == 0 and fits(t)), None)
''')],
    "best_layout": [("min over the fitting candidates with their degrees spelled out", '''
def best_layout(model, cluster, candidates, seq_len, global_batch):
    timed = []
    for cand in candidates:
        degrees = dict(tp=1, cp=1, ep=1, pp=1, dp=1)
        degrees.update(cand)
        try:
            pl = planner.plan(model, cluster, sp=degrees["tp"] > 1, seq_len=seq_len, zero=1,
                              global_batch=global_batch, **degrees)
        except ValueError:
            continue
        if pl.fits:
            timed.append((pl.time.total, len(timed), cand))
    return min(timed)[2] if timed else None
''')],
    "flops_per_byte": [("bytes written as 16 h", '''
def flops_per_tp_byte(model):
    n = planner.params(model)["active"]
    return 6 * n / (model.layers * 16 * model.hidden)
''')],
    "vpp_to_explain": [("the divisors listed first, the run's published value through residual's arithmetic", '''
def vpp_to_explain(run, tolerance):
    layers_per_stage = run.model.layers // run.layout["pp"]
    divisors = [d for d in range(1, layers_per_stage + 1) if layers_per_stage % d == 0]
    for d in divisors:
        layout = {**run.layout, "vpp": d}
        predicted = planner.plan(run.model, run.cluster, **layout).mfu
        if -tolerance <= predicted / run.published - 1 <= tolerance:
            return d
    return None
''')],
    "attention_needed": [("a fixed number of bisection steps from 0", '''
def attention_efficiency_needed(run):
    def gap(a):
        return planner.plan(run.model, run.cluster, attention_efficiency=a, **run.layout).mfu - run.published
    if gap(1.0) < 0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if mid > 0 and gap(mid) >= 0:
            hi = mid
        else:
            lo = mid
    return hi
''')],
}
