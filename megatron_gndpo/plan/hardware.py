"""The GPU a plan is for (:class:`Hardware`) and the byte sizes every estimate counts in."""

from __future__ import annotations

import dataclasses

from megatron_gndpo.logging.throughput import PEAK_BF16_FLOPS

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30

# Part of the GPU the estimate may not use: the CUDA context, NCCL buffers and the caching
# allocator's fragmentation are not in the estimate (torch.cuda.max_memory_allocated excludes
# them too), and together they take several GiB of an 80 GiB device.
RESERVED_FRACTION = 0.10

# Data-sheet numbers of an H100 SXM: dense bf16 tensor-core peak and HBM3 bandwidth.
H100_PEAK_FLOPS = PEAK_BF16_FLOPS["H100"]
H100_HBM_BYTES_PER_S = 3.35e12

# The weight broadcast (rollout.disaggregate) leaves the trainer's rank 0 through one NIC: a
# 200 Gb/s HDR InfiniBand adapter, one per GPU on a DGX H100-class node (NDR 400 Gb/s doubles
# it), is 25 GB/s. NCCL pipelines a broadcast, so the time is bytes / bandwidth whatever the
# number of receivers. Within one node NVLink is ~10x faster: pass --interconnect-gbps.
IB_HDR_BYTES_PER_S = 25e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The GPU the plan is for and the efficiency it assumes."""

    gpu_memory_gib: float = 80.0
    peak_flops: float = H100_PEAK_FLOPS
    mfu: float = 0.35
    hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S
    interconnect_bytes_per_s: float = IB_HDR_BYTES_PER_S  # the trainer -> rollout broadcast

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gib * GIB * (1 - RESERVED_FRACTION)


# What a plan assumes unless told otherwise: an 80 GiB H100 SXM at 35% MFU.
DEFAULT_HARDWARE = Hardware()


def gib(x: float) -> str:
    """``x`` bytes in GiB, one decimal (the plan's tables)."""
    return f"{x / GIB:.1f}"
