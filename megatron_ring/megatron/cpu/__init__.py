"""The CPU harness (a lab for CI and laptops, never used on GPUs): megatron-core's CUDA spots
(:mod:`.core`, ``megatron_cpu``) and Megatron-LM's training loop (:mod:`.training`, ``megatron_training_cpu``;
``python -m megatron_ring.megatron.cpu SCRIPT ARGS``)."""
