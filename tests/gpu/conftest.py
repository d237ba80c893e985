"""tests/gpu: marked `cuda`, skipped with a reason where CUDA is absent (CI on CPU stays green)."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False): not run here")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)
