"""Suite-wide settings.

Multi-process tests start their workers from megatron_ring.launch's fork server (torch imported once
instead of once per worker); here it also imports Megatron-Core and the glue once, so the Megatron
tests' workers start in milliseconds too (a module that is not installed is skipped by the server).
"""
import os

os.environ.setdefault("MEGATRON_RING_PRELOAD", "megatron.core.models.gpt,megatron.core.models.gpt.gpt_layer_specs,"
                                               "megatron_ring.megatron")
