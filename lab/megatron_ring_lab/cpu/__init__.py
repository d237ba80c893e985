"""The CPU harness (a lab for CI and laptops, never used on GPUs): megatron-core's CUDA spots
(:mod:`.core`, ``megatron_cpu``) and Megatron-LM's training loop (:mod:`.training`, ``megatron_training_cpu``;
``python -m megatron_ring_lab.cpu SCRIPT ARGS``)."""
from megatron_ring_lab.cpu.core import cpu_support_enabled, disable_cpu_support, enable_cpu_support, megatron_cpu
from megatron_ring_lab.cpu.training import megatron_training_cpu

__all__ = ["megatron_cpu", "enable_cpu_support", "disable_cpu_support", "cpu_support_enabled", "megatron_training_cpu"]
