"""GPU machine presets for the planner (``python -m megatron_ring_lab.plan --machine NAME``).

Each preset gives what the cost model (``planning/cost_model.py``) needs of a machine: link bandwidth
per GPU inside the NVLink domain and across it, GPUs per NVLink domain, a per-message latency, and the
attention kernel's achieved forward rate. Bandwidths are bytes/s in ONE direction per GPU (a ring sends
to one neighbour while it receives from the other): half of the bidirectional NVLink figure NVIDIA
quotes, and one compute-fabric NIC per GPU across nodes.

Sources (public specification sheets; the figures are the sheets' own, converted as said):

* H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): BF16 Tensor Core
  1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s; DGX H100 datasheet: 8 GPUs, 8 x ConnectX-7
  400 Gb/s (one NDR InfiniBand port per GPU: 50 GB/s).
* H800 SXM: NVIDIA H800 (export variant of H100 SXM): the same Tensor Core rates, NVLink 400 GB/s;
  DeepSeek-V3 technical report (arXiv 2412.19437, section 3.2.2) on its H800 cluster: IB 50 GB/s per GPU
  (and NVLink achieving 160 GB/s of the 200 GB/s per direction).
* A100 SXM 80GB: NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense, NVLink 600 GB/s; DGX A100
  datasheet: 8 x ConnectX-6 200 Gb/s HDR InfiniBand for the compute fabric (25 GB/s per GPU).
* B200: NVIDIA DGX B200 datasheet: 8 GPUs, 72 PFLOPS FP8 training per system (9 PF FP8 with sparsity per
  GPU: BF16 dense 2.25 PF), NVLink 5 1.8 TB/s per GPU, 8 x ConnectX-7 400 Gb/s (50 GB/s per GPU).
* GB200 NVL72: NVIDIA GB200 NVL72 specifications (nvidia.com/en-us/data-center/gb200-nvl72): 72 GPUs in
  one NVLink domain, 1.8 TB/s NVLink per GPU (130 TB/s per rack), FP16/BF16 360 PFLOPS with sparsity per
  rack (2.5 PF dense per GPU). Between racks the sheet gives no per-GPU figure: one 400 Gb/s
  compute-fabric NIC per GPU, as DGX B200, is ASSUMED (``--inter-node-bandwidth`` overrides it).

Not from a sheet: ``latency`` (seconds per message: a NCCL point-to-point message's fixed cost, the
planner's long-standing default, 20 us, across nodes; 10 us inside an NVLink domain is not separated by
the cost model, which takes one latency) and the kernel rate. The kernel rate is a parameter
(``--flops``); its named default per GPU is :data:`KERNEL_FRACTION` of the dense BF16 peak, an assumption
(FlashAttention-class kernels reach roughly half to three quarters of the dense peak in the forward pass)
to be replaced by a measured rate where one is known (docs/strategies.md, "Scale on paper").
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuMachine", "MACHINES", "KERNEL_FRACTION", "machine"]

#: default kernel rate: this fraction of the dense BF16 Tensor Core peak (an assumption, see module doc)
KERNEL_FRACTION = 0.6


@dataclass(frozen=True)
class GpuMachine:
    name: str
    bf16_dense_flops: float  # spec sheet, per GPU
    nvlink_bidir: float  # spec sheet, bytes/s per GPU, both directions together
    inter_node: float  # bytes/s per GPU per direction across NVLink domains (one NIC per GPU)
    gpus_per_node: int  # GPUs per NVLink domain
    latency: float = 20e-6
    memory: float = 80e9  # bytes of HBM per GPU (spec sheet)

    @property
    def intra_node(self) -> float:
        """Bytes/s per GPU in one direction inside the NVLink domain."""
        return self.nvlink_bidir / 2

    @property
    def kernel_flops(self) -> float:
        """The named default attention forward rate (:data:`KERNEL_FRACTION` of the dense BF16 peak)."""
        return KERNEL_FRACTION * self.bf16_dense_flops


MACHINES: dict[str, GpuMachine] = {m.name: m for m in (
    GpuMachine("h100-sxm", bf16_dense_flops=989e12, nvlink_bidir=900e9, inter_node=50e9, gpus_per_node=8),
    GpuMachine("h800", bf16_dense_flops=989e12, nvlink_bidir=400e9, inter_node=50e9, gpus_per_node=8),
    GpuMachine("a100", bf16_dense_flops=312e12, nvlink_bidir=600e9, inter_node=25e9, gpus_per_node=8),
    GpuMachine("b200", bf16_dense_flops=2.25e15, nvlink_bidir=1.8e12, inter_node=50e9, gpus_per_node=8,
               memory=180e9),
    GpuMachine("gb200-nvl72", bf16_dense_flops=2.5e15, nvlink_bidir=1.8e12, inter_node=50e9, gpus_per_node=72,
               memory=186e9),
)}

_ALIASES = {"h100": "h100-sxm", "h100_sxm": "h100-sxm", "h100sxm": "h100-sxm", "a100-sxm": "a100",
            "gb200": "gb200-nvl72", "gb200_nvl72": "gb200-nvl72", "nvl72": "gb200-nvl72"}


def machine(name: str) -> GpuMachine:
    """The preset called ``name`` (case and ``-``/``_``/space insensitive); ValueError listing them otherwise."""
    key = name.strip().lower().replace(" ", "-")
    key = _ALIASES.get(key, _ALIASES.get(key.replace("-", "_"), key))
    if key not in MACHINES:
        raise ValueError(f"unknown machine {name!r}; presets: {', '.join(MACHINES)}")
    return MACHINES[key]
