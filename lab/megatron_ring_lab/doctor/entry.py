"""``torchrun ... -m megatron_ring_lab.doctor.entry SCRIPT ARGS``: one doctor run of a training script.

Installs the recorders of :mod:`.capture`, then runs SCRIPT as ``__main__`` inside megatron_ring's CPU opt-in
for Megatron-LM's loop (the same as ``python -m megatron_ring_lab.cpu SCRIPT ARGS``), and saves
each rank's record into ``$MEGATRON_RING_DOCTOR_OUT`` when the script returns (or exits).
"""
from __future__ import annotations

import os
import runpy
import sys

from megatron_ring import settings
from megatron_ring_lab.doctor import capture


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    folder = settings.doctor_out()
    if not argv or not folder:
        raise SystemExit(f"usage: {capture.OUT_ENV}=DIR python -m megatron_ring_lab.doctor.entry SCRIPT [ARGS...]")
    from megatron_ring_lab.cpu.training import megatron_training_cpu

    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    code = 0
    try:
        with megatron_training_cpu():
            capture.install()
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:  # Megatron's loop exits through sys.exit at the end of some runs
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        capture.write(folder)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
