"""The fault/parity table the multi-node tests fill in (printed by conftest.pytest_terminal_summary and,
with ``MN_REPORT=path``, written as JSON). A module of its own so tests never import ``conftest``."""
REPORT: dict[str, list[dict]] = {"faults": [], "parity": []}
