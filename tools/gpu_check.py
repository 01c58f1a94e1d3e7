"""``make gpu-check``: run the course's programs on the GPUs of this machine, with NCCL.

Each program checks its own results and fails loudly when they are wrong, so a passing
row means the program ran correctly on this machine's GPUs. Also times the chapter-02
GEMM-throughput sweep on one GPU in bf16. Without a GPU it says so and exits 0.

    make gpu-check                 # or: .venv/bin/python tools/gpu_check.py
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (module, arguments, ranks it needs: None for "any", or an exact count; why it may be skipped)
PROGRAMS = [
    ("intralayer.programs.hello_allreduce", [], None),
    ("intralayer.programs.collectives", [], None),
    ("intralayer.programs.bandwidth", ["--max-bytes", str(1 << 26)], None),
    ("intralayer.programs.tp_linear", [], None),
    ("intralayer.programs.tp_block", [], None),
    ("intralayer.programs.sp_block", [], None),
    ("intralayer.programs.sp_gpt", [], None),
    ("intralayer.programs.cp_attention", [], None),
    ("intralayer.programs.cp_tp", [], 4),
    ("intralayer.programs.ep_moe", [], None),
    ("intralayer.programs.inference_decode", [], None),
    ("intralayer.programs.inference_serve", [], None),
    ("intralayer.programs.mesh_demo", [], 4),
    ("intralayer.programs.overlap_tp", ["--time", "--trace", str(Path(tempfile.gettempdir()) / "overlap_tp_traces")],
     None),
]
#: Programs that run on gloo only, and why (they are listed, not run). None at present.
GLOO_ONLY: dict[str, str] = {}


def ranks_for(gpus: int, exact: int | None) -> int | None:
    """How many ranks to start: exactly ``exact`` if the program needs it (None if too few
    GPUs), else the largest of 4, 2, 1 that fits (the programs' default sizes divide 4)."""
    if exact is not None:
        return exact if gpus >= exact else None
    return next(n for n in (4, 2, 1) if n <= gpus)


def gemm_sweep(device: str = "cuda") -> list[tuple[int, int, float]]:
    """TFLOP/s of one fc1 slice (4096, h) × (h, 4h/t) in bf16, best of 5."""
    import torch

    rows = []
    for h in (1024, 4096, 8192):
        for t in (1, 4, 16, 64):
            a = torch.randn(4096, h, device=device, dtype=torch.bfloat16)
            b = torch.randn(h, 4 * h // t, device=device, dtype=torch.bfloat16)
            torch.mm(a, b)
            best = float("inf")
            for _ in range(5):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.mm(a, b)
                stop.record()
                torch.cuda.synchronize()
                best = min(best, start.elapsed_time(stop) / 1e3)
            rows.append((h, t, 2 * 4096 * h * (4 * h // t) / best / 1e12))
    return rows


def main() -> int:
    import torch

    from intralayer import launch

    if not torch.cuda.is_available():
        print("No GPU here: gpu-check runs the programs with NCCL where CUDA GPUs are present. "
              "This machine is CPU-only, so nothing was run (make test covers the CPU).")
        return 0
    gpus = torch.cuda.device_count()
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}, NCCL")
    print(f"{'program':38} {'ranks':>5} {'result':>8} {'seconds':>8}")
    failed = 0
    for module, args, exact in PROGRAMS:
        n = ranks_for(gpus, exact)
        if n is None:
            print(f"{module:38} {'—':>5} {'skipped':>8}   needs {exact} GPUs")
            continue
        t0 = time.perf_counter()
        try:
            launch.run(module, nproc=n, args=args, timeout=600, show=False, env={"PYTHONPATH": str(ROOT)})
            result = "ok"
        except launch.LaunchError as err:
            result, failed = "FAILED", failed + 1
            print(str(err).splitlines()[0])
        print(f"{module:38} {n:5d} {result:>8} {time.perf_counter() - t0:8.1f}")
    for module, why in GLOO_ONLY.items():
        print(f"{module:38} {'—':>5} {'not run':>8}   {why}")
    print("\nGEMM throughput, one fc1 slice (4096, h) × (h, 4h/t), bf16, TFLOP/s")
    print("    h " + "".join(f"{'t=' + str(t):>9}" for t in (1, 4, 16, 64)))
    rows = gemm_sweep()
    for h in (1024, 4096, 8192):
        print(f"{h:5d} " + "".join(f"{v:9.1f}" for hh, _, v in rows if hh == h))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
