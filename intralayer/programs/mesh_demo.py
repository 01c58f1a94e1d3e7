"""Chapter 08: two kinds of parallelism at once on one rank grid, checked against the dense model.

Four ranks form a 2 × 2 grid, ``(dp, tp)``: rank = 2·dp_index + tp_index, built with
``torch.distributed.device_mesh.init_device_mesh``. The model is a GPT block followed by
an MoE layer (with a residual connection):

- the block runs with tensor + sequence parallelism inside each ``tp`` pair (chapter 03);
- the MoE layer runs with expert parallelism across each ``dp`` pair — the two ranks
  that hold the same sequence shard of different batches exchange tokens (chapter 06);
- data parallelism over what remains: each ``dp`` index has its own batch.

After backward, gradients are combined as each parameter is replicated: the block's
shards over ``dp`` (data parallelism), the LayerNorms and row biases first over ``tp``
(sequence parallelism), the experts over ``tp`` (each expert has a copy in each ``tp``
column), the router over everything. Every rank then checks its output and every
gradient against the dense block and MoE layer run on both batches in one process.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.mesh_demo

Four GPUs (NCCL; the grid is 2 × 2, so exactly 4 ranks) — written to be device-agnostic,
but not yet run on a GPU or with NCCL (``make gpu-check`` runs it there)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.mesh_demo
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.device_mesh import init_device_mesh

from intralayer import comm, distributed
from intralayer.expert_parallel import ExpertParallelMoE
from intralayer.model import Block
from intralayer.moe import MoELayer
from intralayer.programs.common import error_label
from intralayer.sequence_parallel import ParallelBlock
from intralayer.tensor_parallel import expected_shards

S, B, H, HEADS, FFN, E, K = 8, 2, 16, 4, 32, 4, 2


def reference(batches, dzs, device):
    """The dense block and MoE layer on both batches; the MoE routes each rank's tokens as one group."""
    torch.manual_seed(0)
    block, layer = Block(H, HEADS).to(device), MoELayer(H, FFN, E, K, capacity_factor=1.25).to(device)
    outs = {}
    for d, (x, dz) in enumerate(zip(batches, dzs)):
        y = block(x)                                                           # (s, b, h)
        for t, (yc, dzc) in enumerate(zip(y.chunk(2, 0), dz.chunk(2, 0))):     # tp index t holds this shard
            tokens = yc.reshape(-1, H)                                         # (s/2·b, h)
            moe_out, _ = layer(tokens)
            z = tokens + moe_out
            (z * dzc.reshape(-1, H)).sum().backward(retain_graph=True)
            outs[(d, t)] = z.detach()
    return block, layer, outs


@record
def main() -> None:
    with distributed.setup() as d:
        if d.world_size != 4:
            raise ValueError(f"the mesh demo is a 2 × 2 grid: run it on 4 ranks, not {d.world_size}")
        mesh = init_device_mesh(d.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
        tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
        di, ti = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
        g = torch.Generator().manual_seed(1)
        batches = [torch.randn(S, B, H, generator=g).to(d.device) for _ in range(2)]
        dzs = [torch.randn(S, B, H, generator=g).to(d.device) for _ in range(2)]
        dense_block, dense_moe, ref_out = reference([x.clone().requires_grad_() for x in batches], dzs, d.device)
        # this rank's shard of both layers, from the same dense weights (same seed)
        torch.manual_seed(0)
        block0 = Block(H, HEADS).to(d.device)
        moe0 = MoELayer(H, FFN, E, K, capacity_factor=1.25).to(d.device)
        block = ParallelBlock.from_dense(block0, tp_group, sequence_parallel=True)
        layer = ExpertParallelMoE.from_dense(moe0, dp_group)
        x = batches[di].chunk(2, 0)[ti].clone().requires_grad_()               # (s/2, b, h): my batch, my shard
        with comm.accounting() as acc:
            y = block(x)                                                       # TP + SP over the tp pair
            tokens = y.reshape(-1, H)
            z = tokens + layer(tokens)                                         # EP over the dp pair
            (z * dzs[di].chunk(2, 0)[ti].reshape(-1, H)).sum().backward()
            block.sync_grads()                                                 # SP: LayerNorms, row biases over tp
            for p in block.parameters():                                       # DP: every block shard over dp
                p.grad = comm.raw_all_reduce(p.grad, dp_group, "backward", "dp grads")
            for p in (layer.w1, layer.w2, layer.w3):                           # an expert's copies across tp
                p.grad = comm.raw_all_reduce(p.grad, tp_group, "backward", "expert grads")
            layer.router.weight.grad = comm.raw_all_reduce(layer.router.weight.grad, None, "backward", "router grads")
        torch.testing.assert_close(z.detach(), ref_out[(di, ti)])             # float32 defaults
        errs = {"output": float((z.detach() - ref_out[(di, ti)]).abs().max())}
        want = expected_shards(block, dense_block, grads=True)
        errs["block grads"] = 0.0
        for name, p in block.named_parameters():
            torch.testing.assert_close(p.grad, want[name])
            errs["block grads"] = max(errs["block grads"], float((p.grad - want[name]).abs().max()))
        errs["expert grads"] = 0.0
        for name in ("w1", "w2", "w3"):
            w = layer.shard(getattr(dense_moe, name).grad, name)
            torch.testing.assert_close(getattr(layer, name).grad, w)
            errs["expert grads"] = max(errs["expert grads"], float((getattr(layer, name).grad - w).abs().max()))
        torch.testing.assert_close(layer.router.weight.grad, dense_moe.router.weight.grad)
        errs["router grads"] = float((layer.router.weight.grad - dense_moe.router.weight.grad).abs().max())
        ops = {}
        for rec in acc.records:
            key = (rec.phase, rec.op, rec.group_size)
            ops[key] = ops.get(key, 0) + 1
        every = [None] * 4
        dist.all_gather_object(every, (di, ti, errs))
        if d.is_main:
            print("2 × 2 grid (dp, tp): rank = 2·dp + tp; block with TP+SP over tp, MoE with EP over dp")
            print(f"{'rank':>4} {'(dp, tp)':>8} " + " ".join(f"{k:>13}" for k in errs))
            for r, (a, b_, e) in enumerate(every):
                print(f"{r:4d} {str((a, b_)):>8} " + " ".join(f"{error_label(v):>13}" for v in e.values()))
            print("collectives on rank 0 (phase, op, group size: count):")
            for (phase, op, n), count in sorted(ops.items()):
                print(f"   {phase:9} {op:15} over {n} ranks: {count}")
            print("all checks passed on every rank")


if __name__ == "__main__":
    main()
