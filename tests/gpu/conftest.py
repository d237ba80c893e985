"""tests/gpu: marked `cuda`, skipped with a reason where CUDA is absent (CI on CPU stays green). A test
parametrized with ``device="cpu"`` is the CPU variant of a GPU check: it is not marked and runs everywhere."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False): not run here")
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cpu":
            continue
        item.add_marker(pytest.mark.cuda)
        if not torch.cuda.is_available():
            item.add_marker(skip)
