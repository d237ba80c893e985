"""The fake-CUDA tier: needs a CUDA build of torch (it runs on CPU; nothing initialises CUDA)."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="the fake-CUDA tier needs a CUDA build of torch (torch.version.cuda is None "
                                   "here); scripts/test.sh runs it on .venv312")
    for item in items:
        if str(item.fspath).startswith(here) and torch.version.cuda is None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_fake_tensors_kept_between_tests():
    """Device copies of the plan's index tensors are cached (schedules/on_device.py, and each BlockMask of the
    schedule cache); under FakeTensorMode they are fake tensors of that test's mode: forget them after it."""
    yield
    from megatron_ring.kernels import varlen
    from megatron_ring.schedules import masks, on_device

    on_device.clear()
    masks._CACHE.clear()
    # whether a case fits the variable-length kernel is asked once per (device, dtype, head dim): tests change the
    # fake GPU's architecture under the same device name
    for kernel in varlen._VARLEN_CUDA.values():
        kernel._fits.clear()
