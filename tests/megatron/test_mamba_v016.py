"""``ring_hybrid_stack_spec`` on the megatron-core 0.16 form of the hybrid stack (``MambaModel`` / ``MambaStack``,
what Megatron-LM core_v0.16.1's ``pretrain_mamba.py`` builds from ``--spec``).

megatron-core 0.16.1's Mamba mixer imports triton at module level (``megatron/core/ssm/mamba_mixer.py:22`` ->
``megatron/core/inference/contexts/attention_context/triton/tensor_ops.py:6``), which the Python 3.11 venv
(where the 0.16.1 wheel is installed) lacks. So:

* ``test_the_spec_name_loads_no_mamba_mixer``: on any install, importing the spec package and naming
  ``ring_hybrid_stack_spec`` does not load the Mamba mixer (so on the 3.11 venv, without triton, the import
  succeeds: the ``--spec ring_layer_spec`` line of core_v0.16.1's ``pretrain_gpt.py`` needs no triton).
* ``test_mamba_model_cp_equals_megatron_cp1``: runs in an interpreter that has triton (the Python 3.12 venv)
  with a megatron-core of the 0.16 form put first on ``PYTHONPATH`` in a child process: the current
  interpreter's own if it is that form, else the ``megatron/core`` under ``MEGATRON_RING_MCORE_016`` (a
  directory holding ``megatron/core``: a core_v0.16.1 checkout or the 0.16.1 wheel's site-packages), else the
  one in this repository's ``.venv`` (scripts/setup_env.sh; the 0.16.1 wheel, pure Python). Nothing is
  downloaded; without one of them, or without triton, it is skipped saying which. ``MambaModel`` with
  ``ring_hybrid_stack_spec`` at CP = 2 and 4 equals CP = 1 with Megatron's own attention (losses of 2 steps
  within the model-level rule of tests/helpers/numerics.py, step-0 gradients within 8 eps sqrt(tokens)
  max|g|, as test_hybrid_model.py); the module tree differs from Megatron's only in the attention layer's
  core attention; the control (Megatron's local attention at CP = 2) refuses.
"""
from __future__ import annotations

import glob
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import ROOT, TIMEOUT_S
from tests.helpers.numerics import model_loss_tol
from tests.megatron import mamba_v016_workers as MW

PATTERN = "M*M-"
CPS = (2, 4)
#: why the 0.16 form cannot be imported without triton (file:line of megatron-core 0.16.1)
NEEDS_TRITON = ("megatron-core 0.16.1's Mamba mixer imports triton at module level (megatron/core/ssm/"
                "mamba_mixer.py:22 -> inference/contexts/attention_context/triton/tensor_ops.py:6)")


def _is_v016_form(core: Path) -> bool:
    """``megatron/core`` with the hybrid stack as ``ssm/mamba_block.MambaStack`` + ``models/mamba`` and no
    ``models/hybrid`` (which replaced them from 0.19)."""
    return (core / "ssm" / "mamba_block.py").is_file() and (core / "models" / "mamba" / "mamba_layer_specs.py").is_file() \
        and not (core / "models" / "hybrid").exists()


def _v016_core() -> tuple[Path | None, str]:
    """(``megatron/core`` of the 0.16 form, where it was found); (None, why not)."""
    spec = importlib.util.find_spec("megatron.core")
    own = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    if own is not None and _is_v016_form(own):
        return own, "this interpreter's"
    env = os.environ.get("MEGATRON_RING_MCORE_016")
    if env:
        core = Path(env) / "megatron" / "core"
        if not _is_v016_form(core):
            pytest.fail(f"MEGATRON_RING_MCORE_016={env}: {core} is not megatron-core's 0.16 form "
                        "(ssm/mamba_block.py and models/mamba without models/hybrid)")
        return core, "MEGATRON_RING_MCORE_016"
    for found in sorted(glob.glob(os.path.join(ROOT, ".venv", "lib", "python3*", "site-packages", "megatron", "core"))):
        if _is_v016_form(Path(found)):
            return Path(found), "this repository's .venv"
    return None, ("no megatron-core of the 0.16 form here (this interpreter's is another; set "
                  "MEGATRON_RING_MCORE_016 to a directory holding one's megatron/core, or create .venv)")


def _child_env(tmp: Path, core: Path | None) -> dict:
    """PYTHONPATH for a child: the 0.16 ``megatron/core`` first (as the only ``megatron`` package: a regular
    package in ``tmp`` whose ``core`` is a link, so nothing of another megatron install is merged in), then
    this repository."""
    path = [ROOT]
    if core is not None:
        (tmp / "megatron").mkdir()
        (tmp / "megatron" / "__init__.py").write_text("")
        (tmp / "megatron" / "core").symlink_to(core, target_is_directory=True)
        path.insert(0, str(tmp))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))


@pytest.mark.slow
def test_the_spec_name_loads_no_mamba_mixer():
    code = ("import sys; from megatron_ring.megatron.spec import ring_hybrid_stack_spec as s, ring_layer_spec; "
            "from megatron.core.transformer.spec_utils import ModuleSpec; "
            "assert isinstance(s, ModuleSpec) and 'resolved at first use' in repr(s), repr(s); "
            "print(sorted(m for m in sys.modules if m.endswith('mamba_mixer')))")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.slow
def test_mamba_model_cp_equals_megatron_cp1(tmp_path):
    pytest.importorskip("einops", reason="Megatron's Mamba layers import einops (pinned in requirements/)")
    if importlib.util.find_spec("triton") is None:
        pytest.skip(f"no triton in this interpreter: {NEEDS_TRITON}")
    core, where = _v016_core()
    if core is None:
        pytest.skip(where)
    own = where == "this interpreter's"
    out = tmp_path / "result.pt"
    proc = subprocess.run([sys.executable, "-m", "tests.megatron.mamba_v016_workers", str(out), PATTERN,
                           *map(str, CPS)], cwd=ROOT, env=_child_env(tmp_path, None if own else core),
                          capture_output=True, text=True, timeout=4 * TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = torch.load(out, weights_only=False)
    # the child ran the 0.16 form found above, not another megatron-core
    assert res["stack"] == "MambaStack" and Path(res["megatron_core"]).resolve() == core.resolve(), res["megatron_core"]
    assert res["version"].startswith("0.16."), res["version"]
    ref = res["reference"]
    m = MW.MODEL
    tokens = m["micro_batch"] * m["seq"]
    sizes = dict(seq=m["seq"], hidden=m["hidden_size"], layers=len(PATTERN), ffn=2 * m["hidden_size"], tokens=tokens)
    gmax = max(float(g.abs().max()) for g in ref["grads"].values())
    grad_tol = 8 * torch.finfo(torch.float32).eps * math.sqrt(tokens) * gmax
    for cp in CPS:
        got = res[cp]
        diff = [(n, a, b) for (n, a), (_, b) in zip(got["modules"], ref["modules"]) if a != b]
        assert [n for n, _ in got["modules"]] == [n for n, _ in ref["modules"]]
        assert diff == [("decoder.layers.1.self_attention.core_attention", "RingDotProductAttention",
                         "DotProductAttention")], diff
        assert len(got["losses"]) == len(ref["losses"]) == MW.STEPS
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            tol = model_loss_tol(b, step=step + 1, **sizes)
            assert abs(a - b) <= tol, f"CP={cp} step {step}: loss {a} vs {b} (|d| {abs(a - b):.3g} > {tol:.3g})"
        assert set(got["grads"]) == set(ref["grads"])
        worst = max(float((got["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
        assert worst <= grad_tol, f"CP={cp}: step-0 gradients differ by {worst:.3g} > {grad_tol:.3g}"
    assert "Context parallelism is only supported by TEDotProductAttention" in res["control"], res["control"][-2000:]
