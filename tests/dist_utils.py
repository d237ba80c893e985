"""Compatibility name for tests written before tests/ was a package: use ``tests.helpers.launch``."""
from tests.helpers.launch import WorkerError, run_distributed  # noqa: F401
