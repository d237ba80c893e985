"""Suite-wide settings.

Multi-process tests start their workers from megatron_ring.tools.launch's fork server (torch imported once
instead of once per worker); on a machine without CUDA it also imports Megatron-Core and the glue once,
so the Megatron tests' workers start in milliseconds too (a module that is not installed is skipped by
the server). With CUDA only torch is preloaded: a module that touched CUDA at import would leave the
server's forked workers unable to use it.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("MEGATRON_RING_PRELOAD", "megatron.core.models.gpt,"
                                                   "megatron.core.models.gpt.gpt_layer_specs,megatron_ring.megatron")
