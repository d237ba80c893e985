"""Megatron-Bridge's modules the Bridge tests' workers use, imported once in the fork server of that pytest run
(``MEGATRON_RING_TEST_PRELOAD_BRIDGE=1``, which scripts/test.sh sets for it; tests/conftest.py then adds this module
to the server's preload), through the TransformerEngine stand-in where TransformerEngine is missing, as the workers
import them: each worker forked from the server finds them imported instead of importing Bridge again (about 11 s
of CPU per worker on 2 cores). An import error here leaves the workers to import Bridge themselves (multiprocessing
ignores a preload's ImportError)."""
from tests.megatron.bridge_import import import_bridge

import_bridge("megatron.bridge.models.gpt_provider", "megatron.bridge.training.gpt_step",
              "megatron.bridge.training.initialize", "megatron.bridge.models.hybrid.hybrid_provider")
