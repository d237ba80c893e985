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
