"""Compatibility name for tests written before tests/ was a package: use ``tests.helpers.reference``."""
from tests.helpers.reference import doc_attention_reference  # noqa: F401
