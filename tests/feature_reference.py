"""Compatibility name for tests written before tests/ was a package: use ``tests.helpers.reference``."""
from tests.helpers.reference import feature_reference, visible  # noqa: F401
