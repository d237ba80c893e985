"""tests/gpu: marked `cuda`, skipped with a reason where CUDA is absent (CI on CPU stays green)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/ helpers (reference, ring_fakes)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False): not run here")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)
