"""GPU and link facts, each with its source: the one place the course's chapters and planner read them.

:data:`LINKS` (one-way bandwidth per GPU), :data:`NVLINK_DOMAIN` (GPUs one NVLink domain joins) and
the GPUs' dense peaks; :mod:`intralayer.collectives`, :mod:`intralayer.tensor_parallel` and
:mod:`intralayer.planner` import them from here (the first two also under their old names).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link's bandwidth one way, per GPU, in bytes/s, and where the figure comes from."""

    bandwidth: float
    source: str


#: One-way bandwidth per GPU. NVLink's 900 GB/s is the two directions together.
LINKS = {
    "NVLink 4 (H100 SXM)": Link(450e9, "NVIDIA H100 datasheet: 900 GB/s NVLink per GPU, both directions"),
    "InfiniBand NDR (1 NIC)": Link(50e9, "NVIDIA ConnectX-7 / NDR: 400 Gb/s per port"),
    "NVLink 5 (GB200 NVL72)": Link(900e9, "NVIDIA GB200 NVL72: 1.8 TB/s NVLink per GPU, both directions, 72 GPUs"),
    "PCIe 5.0 x16": Link(63e9, "PCI-SIG PCIe 5.0: 32 GT/s × 16 lanes, 128b/130b coding"),
    "NVLink 3 (A100 SXM)": Link(300e9, "NVIDIA A100 datasheet: 600 GB/s NVLink per GPU, both directions"),
    "InfiniBand HDR (1 NIC)": Link(25e9, "NVIDIA ConnectX-6 / HDR: 200 Gb/s per port"),
}

#: GPUs that one NVLink domain joins, for the NVLink links of :data:`LINKS`. An HGX/DGX H100 server
#: joins 8 H100 GPUs through NVSwitch; a GB200 NVL72 rack joins 72. A tensor-parallel group on such a
#: link must fit in one domain. (NVIDIA's NVLink Switch System stretches NVLink 4 across servers, up to
#: 256 GPUs in a DGX GH200; not modelled.)
NVLINK_DOMAIN = {"NVLink 4 (H100 SXM)": 8, "NVLink 5 (GB200 NVL72)": 72}

#: H100 SXM dense bf16 peak, FLOP/s (NVIDIA H100 datasheet; FP8 is twice it).
H100_BF16_PEAK = 989e12
#: A100 SXM dense bf16 peak, FLOP/s (NVIDIA A100 datasheet).
A100_BF16_PEAK = 312e12
#: GB200 dense bf16 peak per GPU, FLOP/s (NVIDIA GB200 NVL72, vendor figure).
GB200_BF16_PEAK = 2.5e15
