"""The links a plan on several GPUs communicates over, and what a collective costs on them.

A group of ranks inside one node talks over NVLink (the GPU's `interconnect` bus bandwidth, planning/gpus.py);
a group that spans nodes is bound by the network (`internode`, per GPU); host-device copies run over PCIe
(`host_link`). Each figure is named in gpus.py and can be overridden (ParallelSettings: --intra-node-bandwidth,
--inter-node-bandwidth, --host-bandwidth, in GB/s). A collective of a group of g ranks costs its bytes at the
bandwidth of the link its group spans plus one latency (gpus.LATENCY):

- all-gather of a tensor of B bytes (its shards 1/g each): each rank receives B (g - 1) / g;
- reduce-scatter of B bytes: each rank sends and receives B (g - 1) / g;
- all-to-all of B bytes a rank: it sends B (g - 1) / g (the rest is its own).

NCCL's bus bandwidth is defined so that these are the bytes that cross each rank's link (its busbw for
all-gather and reduce-scatter is algbw x (g - 1) / g).
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_fast.planning.gpus import GPU, HOST_MEMORY_BANDWIDTH, LATENCY
from dllm_fast.planning.layout import ParallelSettings


@dataclass(frozen=True)
class Links:
    """Bytes/s of each link, seconds of latency of each, GPUs a node, the host's memory bandwidth a node."""

    intra: float
    inter: float
    host: float
    gpus_per_node: int
    latency_intra: float = LATENCY["intra"]
    latency_inter: float = LATENCY["inter"]
    host_memory: float = HOST_MEMORY_BANDWIDTH

    def spans_nodes(self, ranks: int) -> bool:
        """Whether a group of `ranks` ranks (consecutive, or one a node apart) spans nodes."""
        return ranks > self.gpus_per_node

    def collective(self, crossing: float, ranks: int, *, count: int = 1, across_nodes: bool | None = None) -> float:
        """Seconds of `count` collectives whose bytes crossing each rank's link are `crossing` in all, in a group
        of `ranks` (across_nodes: whether it spans nodes, default by its size). A group of one costs nothing."""
        if ranks <= 1 or crossing <= 0:
            return 0.0
        inter = self.spans_nodes(ranks) if across_nodes is None else across_nodes
        bandwidth, latency = (self.inter, self.latency_inter) if inter else (self.intra, self.latency_intra)
        if not bandwidth:
            raise ValueError("the plan communicates across nodes, and the GPU's network bandwidth is unknown "
                             "(planning/gpus.py); give --inter-node-bandwidth GB/s." if inter else
                             "the GPU's link bandwidth is unknown (planning/gpus.py); give --intra-node-bandwidth "
                             "GB/s.")
        return crossing / bandwidth + count * latency

    def host_copy(self, size: float) -> float:
        """Seconds to copy `size` bytes between host and device (one direction)."""
        if size <= 0:
            return 0.0
        if not self.host:
            raise ValueError("--fsdp-offload true and --reference-offload true copy between host and GPU, whose "
                             "bandwidth is unknown for this GPU (planning/gpus.py); give --host-bandwidth GB/s.")
        return size / self.host


def links(gpu: GPU, settings: ParallelSettings) -> Links:
    """The links of `settings` on `gpu`, the flags' figures over the GPU entry's."""
    return Links(intra=settings.intra_node_bandwidth or gpu.interconnect,
                 inter=settings.inter_node_bandwidth or gpu.internode,
                 host=settings.host_bandwidth or gpu.host_link, gpus_per_node=settings.gpus_per_node)


def all_gather(size: float, ranks: int) -> float:
    """Bytes crossing each rank's link to all-gather `size` bytes over `ranks`."""
    return size * (ranks - 1) / ranks if ranks > 1 else 0.0


reduce_scatter = all_gather  # the same bytes cross each link
all_to_all = all_gather  # a rank's bytes less the share that stays with it
