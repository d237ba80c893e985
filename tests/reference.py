"""Compatibility name for tests written before tests/ was a package: use ``tests.helpers.reference``."""
from tests.helpers.reference import attention_reference, outputs_and_grads, sdpa  # noqa: F401
