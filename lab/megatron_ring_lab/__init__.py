"""megatron_ring's lab (a distribution of its own, lab/pyproject.toml; the library never imports it).

The CPU harness that runs megatron-core and Megatron-LM's loop on CPU/gloo (:mod:`.cpu`,
``python -m megatron_ring_lab.cpu SCRIPT ARGS``), the CP doctor (:mod:`.doctor`), the benchmark CLI
(:mod:`.bench`, ``python -m megatron_ring_lab.benchmark``), the planner CLI (:mod:`.planner`,
``python -m megatron_ring_lab.plan``) and the local multi-process launcher (:mod:`.launch`).
"""
