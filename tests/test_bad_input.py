"""Bad input is refused with a message that says what was wrong, before any collective.

(a) The rules a notebook can check before launching a single process: every degree that
    must divide something (hidden size, heads, MLP width, vocabulary by t; sequence by t
    under sequence parallelism; sequence by P or 2P, heads by P for Ulysses; experts by P;
    the world size by the mesh; a planner layout). Each ValueError names the rule and
    the numbers.
(b) Every parallel module and function × every kind of bad input (wrong last dimension,
    too few or too many dimensions, float64, bfloat16 or integer into float32, a tensor on
    another device — ``meta`` stands in for one on a CPU-only machine — or no tensor at
    all), on one rank: a 1-rank gloo group in this process. Each raises ValueError naming
    the module or function, the argument, what was expected and what came, with no
    collective recorded. The table of cases is tests/programs/bad_input_checks.py.
(c) The same table on 2 real ranks, with the rules that bite only on more than one rank
    and inputs no backend can send: launched through the pool (``intralayer.ranks``); a rank
    that raised late would leave its peer waiting in a collective.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from intralayer import comm, planner, rules
from intralayer import context_parallel as cp
from intralayer import expert_parallel as ep
from intralayer import sequence_parallel as sp
from intralayer import tensor_parallel as tp

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import bad_input_checks as cases
ENV = {"PYTHONPATH": str(ROOT)}


def refused(fn, words, error=ValueError) -> str:
    """``fn()`` raises ``error`` whose message holds every one of ``words``; no collective ran."""
    with comm.accounting() as acc:
        with pytest.raises(error) as info:
            fn()
    message = str(info.value)
    missing = [w for w in words if w not in message]
    assert not missing, f"the message {message!r} does not mention {missing}"
    assert not acc.records, f"{len(acc.records)} collectives were issued before the error: {acc.table()}"
    return message


# ------------------------------------------------------------------ (a) the rules, before any process

GPT3 = planner.MODELS["GPT-3 175B"]
H100 = planner.CLUSTERS["1024× H100 (128 nodes of 8, InfiniBand)"]
MIXTRAL = planner.MODELS["Mixtral 8x7B"]

RULES = [
    # tensor parallelism: hidden, heads, MLP width and vocabulary by t
    ("hidden by t", lambda: tp.check_degrees(4, h=10), ["hidden size 10", "tensor-parallel degree t=4"]),
    ("heads by t", lambda: tp.check_degrees(4, h=24, heads=6), ["number of heads 6", "t=4"]),
    ("hidden by heads", lambda: tp.check_degrees(2, h=16, heads=6), ["hidden size 16", "number of heads 6"]),
    ("ffn by t", lambda: tp.check_degrees(2, ffn=7), ["MLP width 7", "t=2"]),
    ("vocab by t", lambda: tp.check_degrees(8, vocab=50257), ["vocabulary size 50257", "t=8"]),
    ("t whole", lambda: tp.check_degrees(0, h=16), ["tensor-parallel degree t", "whole number", "got 0"]),
    # grouped-query attention: key/value heads a multiple or a divisor of t (Megatron-Core's query groups)
    ("kv heads by t", lambda: tp.check_degrees(4, h=6144, heads=48, kv_heads=6),
     ["key/value heads 6", "neither a multiple nor a divisor", "t=4"]),
    ("heads by kv heads", lambda: tp.check_degrees(2, h=16, heads=4, kv_heads=3),
     ["number of heads 4", "key/value heads 3"]),
    ("fused q|k|v by t", lambda: tp.check_degrees(4, h=12, heads=4, kv_heads=1),
     ["fused q|k|v width", "18", "t=4"]),
    ("kv heads whole", lambda: tp.check_degrees(2, h=16, heads=4, kv_heads=0),
     ["number of key/value heads", "whole number", "got 0"]),
    ("kv heads without heads", lambda: tp.check_degrees(2, h=16, kv_heads=2), ["key/value heads", "pass heads"]),
    ("dense kv heads", lambda: tp.Attention(16, 4, kv_heads=3), ["number of heads 4", "key/value heads 3"]),
    ("linear costs", lambda: tp.linear_costs(8, 16, 30, 4, "column"), ["h_out (columns of A) = 30", "t=4"]),
    # sequence parallelism: the sequence by t
    ("sp sequence by t", lambda: sp.check_sequence(10, 4), ["sequence length s=10", "tensor-parallel degree t=4",
                                                             "s/t"]),
    ("sp t whole", lambda: sp.check_sequence(8, 0), ["tensor-parallel degree t", "whole number", "got 0"]),
    ("sp s whole", lambda: sp.check_sequence(8.0, 2), ["sequence length s", "whole number", "got 8.0"]),
    # context parallelism: sequence by P or 2P; heads by P for Ulysses
    ("zigzag by 2P", lambda: cp.check_sequence(12, 4, "zigzag"), ["sequence length 12", "2P = 8", "zigzag"]),
    ("contiguous by P", lambda: cp.check_sequence(6, 4, "contiguous"), ["sequence length 6", "P = 4"]),
    ("ulysses heads by P", lambda: cp.check_ulysses(6, 4), ["6 heads", "context-parallel degree P=4"]),
    ("ulysses P > heads", lambda: cp.check_ulysses(2, 4), ["2 heads", "P=4", "(P > heads)"]),
    ("ulysses sequence by P", lambda: cp.check_ulysses(8, 4, s=30), ["sequence length 30", "P = 4"]),
    ("ulysses P whole", lambda: cp.check_ulysses(8, 0), ["context-parallel degree P", "whole number", "got 0"]),
    ("ulysses heads whole", lambda: cp.check_ulysses(0, 2), ["number of heads", "whole number", "got 0"]),
    # grouped-query attention under Ulysses (and inside tensor parallelism: a/t and a_kv/t by P)
    ("ulysses kv heads by P", lambda: cp.check_ulysses(4, 2, kv_heads=1),
     ["kv_heads/P", "1 key/value heads", "context-parallel degree P=2", "(P > kv_heads)"]),
    ("ulysses heads by kv heads", lambda: cp.check_ulysses(8, 2, kv_heads=3),
     ["number of heads 8", "key/value heads 3"]),
    ("ring overlap phase", lambda: cp.overlap_tokens(5e14, 5e10, phase="bwd"), ["phase must be", "'bwd'"]),
    # expert parallelism: experts by P, ranks by nodes
    ("experts by P", lambda: ep.check_placement(6, 4), ["6 experts", "P=4"]),
    ("experts whole", lambda: ep.check_placement(0, 4), ["number of experts", "whole number", "got 0"]),
    ("P whole", lambda: ep.check_placement(8, 0), ["expert-parallel degree P", "whole number", "got 0"]),
    ("ranks by nodes", lambda: ep.check_nodes(4, 3), ["4 ranks", "3 nodes"]),
    # the mesh: world size by the product of the degrees
    ("mesh divides world", lambda: rules.check_mesh(6, tp=4), ["world size 6", "tp=4", "4 ranks"]),
    ("mesh of two degrees", lambda: rules.check_mesh(8, tp=2, cp=3), ["world size 8", "tp=2 × cp=3", "6 ranks"]),
    ("exact mesh", lambda: rules.check_mesh(8, exact=True, dp=2, tp=2), ["dp=2 × tp=2", "4 ranks",
                                                                         "world size is 8"]),
    ("mesh degree whole", lambda: rules.check_mesh(8, tp=0), ["degree tp", "whole number", "got 0"]),
    ("mesh world whole", lambda: rules.check_mesh(2.5, tp=1), ["world size", "whole number", "got 2.5"]),
    ("mesh without degrees", lambda: rules.check_mesh(8), ["at least one degree"]),
    # the planner's layout: GPUs by the cluster, heads by tp, sequence by 2·cp, experts by ep
    ("planner gpus", lambda: planner.check_layout(GPT3, H100, tp=8, pp=8, dp=3),
     ["tp·cp·pp·dp", "192", "1024"]),
    ("planner heads", lambda: planner.check_layout(GPT3, H100, tp=64), ["96 attention heads", "tp=64"]),
    ("planner zigzag", lambda: planner.check_layout(GPT3, H100, cp=4, seq_len=2052), ["seq_len 2052", "2·cp = 8"]),
    ("planner experts", lambda: planner.check_layout(MIXTRAL, H100, ep=16, dp=16), ["8 experts", "ep=16"]),
]


@pytest.mark.parametrize("fn, words", [pytest.param(fn, words, id=name) for name, fn, words in RULES])
def test_each_rule_names_itself_and_the_numbers(fn, words):
    refused(fn, words)


@pytest.mark.parametrize("fn", [
    lambda: tp.check_degrees(4, h=16, heads=4, ffn=64, vocab=32), lambda: tp.check_degrees(16, h=8192, heads=64, kv_heads=8),
    lambda: sp.check_sequence(8, 4),
    lambda: cp.check_sequence(16, 4, "zigzag"), lambda: cp.check_ulysses(8, 4, s=16),
    lambda: ep.check_placement(8, 4), lambda: ep.check_nodes(8, 2),
    lambda: planner.check_layout(GPT3, H100, tp=8, pp=8, dp=16),
], ids=["tp", "tp gqa", "sp", "cp", "ulysses", "ep", "nodes", "planner"])
def test_valid_layouts_pass_the_rules(fn):
    assert fn() is None


@pytest.mark.parametrize("world, exact, degrees, left", [
    (8, False, dict(tp=2), 4), (8, False, dict(tp=2, cp=2), 2), (4, True, dict(dp=2, tp=2), 1),
    (6, False, dict(tp=1), 6), (72, False, dict(tp=8, ep=3), 3),
])
def test_check_mesh_returns_the_data_parallel_degree(world, exact, degrees, left):
    assert rules.check_mesh(world, exact, **degrees) == left


def test_the_rules_start_no_process_group():
    assert not dist.is_initialized()


# ------------------------------------------------------------------ (b) every module × bad input, one rank

@pytest.fixture(scope="module")
def solo_group(tmp_path_factory):
    """A one-rank gloo group in this process (no launch needed), for this file's tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLOO_SOCKET_IFNAME", "lo")
        store = tmp_path_factory.mktemp("solo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def built(solo_group):
    """Every target of the table, built once on the 1-rank group."""
    return cases.targets(1, None)


@pytest.fixture(scope="module")
def extra(solo_group):
    return cases.extra_cases(1, None)


def test_the_table_lists_every_target(built):
    assert set(built) == set(cases.TARGET_KINDS)
    assert len(cases.GRID) == sum(len(k) for k in cases.TARGET_KINDS.values())


@pytest.mark.parametrize("target, kind", [pytest.param(t, k, id=f"{t}-{k}") for t, k in cases.GRID])
def test_bad_input_is_refused_before_any_collective(built, target, kind):
    fn, words = cases.case(built, target, kind)
    refused(fn, words)


@pytest.mark.parametrize("name", cases.EXTRA)
def test_bad_other_arguments_are_refused(extra, name):
    fn, words = extra[name]
    refused(fn, words)


@pytest.mark.parametrize("target", list(cases.TARGET_KINDS))
def test_the_good_input_of_each_target_runs(built, target):
    """The table's errors come from the bad input alone: the good one goes through."""
    good, call, _ = built[target]
    with torch.no_grad():
        out = call(good)
    out = out[0] if isinstance(out, tuple) else out
    assert isinstance(out, torch.Tensor) and torch.isfinite(out.float()).all()


def test_two_d_input_to_the_layers_that_take_it_is_fine(built):
    """(s·b, h) is refused by the blocks, but a linear layer and the MLP take it."""
    x = torch.randn(cases.S * cases.B, cases.H)
    with torch.no_grad():
        for target in ("ColumnParallelLinear", "ParallelMLP"):
            assert built[target][1](x).shape[0] == cases.S * cases.B


def test_the_group_device_check_names_the_backend(solo_group):
    message = refused(lambda: rules.check_group_device(torch.zeros(2, device="meta"), "x", "f", None),
                      ["f: x is on meta", "gloo", "cpu"])
    assert "move it there" in message
    rules.check_group_device(torch.zeros(2), "x", "f", None)          # CPU on gloo: fine


@pytest.mark.parametrize("backend, ok", [("nccl", False), ("cpu:gloo,cuda:nccl", True), ("mpi", True)])
def test_the_group_device_check_on_other_backends(solo_group, monkeypatch, backend, ok):
    """NCCL sends only CUDA tensors (no GPU here: the backend's name is faked); an unknown
    backend is not second-guessed, a mixed one is read from its name."""
    monkeypatch.setattr(rules.dist, "get_backend", lambda group=None: backend)
    x = torch.zeros(2)
    if ok:
        rules.check_group_device(x, "x", "f", None)
    else:
        refused(lambda: rules.check_group_device(x, "x", "f", None), ["f: x is on cpu", "nccl", "cuda"])
    refused(lambda: rules.check_group_device(x.to("meta"), "x", "f", None), ["x is on meta", backend])


def test_check_tensor_messages():
    for args, kwargs, words in [
        ((torch.zeros(2, 3), "x", "f"), dict(dims=3, layout="(s, b, h)"), ["f: x", "3 dimensions", "(s, b, h)",
                                                                           "got 2", "(2, 3)"]),
        ((torch.zeros(2, 3), "x", "f"), dict(dims=(3, 4)), ["3 or 4 dimensions"]),
        ((torch.zeros(2, 3), "x", "f"), dict(last=4, last_is="w's in_features"), ["size 4 (w's in_features)",
                                                                                  "(2, 3)"]),
        ((torch.zeros(3), "x", "f"), dict(min_dims=2), ["at least 2 dimensions", "got 1"]),
        ((torch.zeros(3, dtype=torch.int32), "ids", "f"), {}, ["f: ids", "floating-point", "torch.int32"]),
        ((3.0, "x", "f"), {}, ["f: x must be a torch.Tensor", "float"]),
    ]:
        refused(lambda: rules.check_tensor(*args, **kwargs), words)
    rules.check_tensor(torch.zeros(3, dtype=torch.int64), "ids", "f", floating=False)   # ids may be integers
    refused(lambda: rules.check_like(torch.zeros(2), "x", torch.zeros(2, dtype=torch.float16), "w", "f"),
            ["f: x has dtype torch.float32", "w has dtype torch.float16"])


# ------------------------------------------------------------------ (c) on 2 real ranks

def test_every_case_is_refused_on_two_ranks_and_the_ranks_still_talk(pool):
    result = pool("tests.programs.bad_input_checks", 2, env=ENV, timeout=120)
    assert f"{cases.MARKER} 2 ranks" in result.output
    counted = int(re.search(r"\((\d+) cases\)", result.output).group(1))
    assert counted >= len(cases.GRID) + len(cases.EXTRA) + 8
    assert all("Traceback" not in text for text in result.stderr.values())
