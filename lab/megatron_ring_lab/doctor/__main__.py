"""``python -m megatron_ring_lab.doctor [--cp 2,4] [--iters N] [--json FILE] [--static] -- SCRIPT ARGS...``"""
import sys

from megatron_ring_lab.doctor.cli import main

sys.exit(main())
