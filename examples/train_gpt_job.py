"""Run examples/train_gpt.py under torchrun on this machine and return its JSON summary."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run_train_gpt(nproc: int, train_args: list[str], *, timeout: float, master_port: int = 0,
                  quiet: bool = False) -> dict | None:
    """``torchrun --nproc-per-node nproc train_gpt.py train_args``; the summary train_gpt writes.

    ``master_port=0`` lets ``torchrun --standalone`` pick a free port. Not ``quiet``: the command and
    its output are shown and a failure raises; ``quiet``: output is captured and a failure prints its
    last line and returns None.
    """
    rdzv = ["--standalone"] if not master_port else ["--master-port", str(master_port)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *rdzv,
               os.path.join(HERE, "train_gpt.py"), *train_args, "--log-json", out]
        if not quiet:
            print(f"$ {' '.join(cmd[1:])}", flush=True)
        r = subprocess.run(cmd, timeout=timeout, check=not quiet, capture_output=quiet, text=True)
        if r.returncode != 0:
            print(f"  {' '.join(train_args)}: failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
            return None
        with open(out) as f:
            return json.load(f)
