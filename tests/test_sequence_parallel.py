"""Tests of intralayer.sequence_parallel.

(a) The sequence-parallel block against its dense twin on 2 and 4 ranks — outputs,
    gradients, collectives, memory per rank and bad input (tests/programs/sp_checks.py,
    launched like the tensor-parallel checks).
(b) Building a sequence-parallel module outside a process group.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
import torch.nn as nn

from intralayer import model
from intralayer import sequence_parallel as sp

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import sp_checks
ENV = {"PYTHONPATH": str(ROOT)}

H, HEADS = 16, 4


# ------------------------------------------------------------------ (a) on real ranks

@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("check", sp_checks.CHECKS, ids=lambda c: c.__name__)
def test_sequence_parallel_block_matches_its_dense_twin(on_ranks, nproc, check):
    on_ranks(sp_checks, check, nproc, env=ENV, timeout=90)


# ------------------------------------------------------------------ (b) outside a process group

@pytest.mark.parametrize("build", [
    pytest.param(lambda: sp.ParallelBlock.from_dense(model.Block(H, HEADS), None), id="block-sp"),
    pytest.param(lambda: sp.ParallelBlock.from_dense(model.Block(H, HEADS), None, sequence_parallel=False),
                 id="block-tp"),
    pytest.param(lambda: sp.ParallelBlock.from_dense(model.Block(H, HEADS, recompute="full"), None,
                                                     keep_gathered=True), id="block-keep-gathered"),
    pytest.param(lambda: sp.SequenceParallelColumnLinear.from_dense(nn.Linear(H, 2 * H), None), id="column"),
    pytest.param(lambda: sp.SequenceParallelRowLinear.from_dense(nn.Linear(2 * H, H), None), id="row"),
])
def test_building_outside_a_process_group_says_to_use_setup(build):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"process group.*distributed\.setup\(\)"):
        build()
