"""The CP doctor: does a Megatron config train the same at CP=k as at CP=1? (``python -m megatron_ring_lab.doctor``)

A tool, like :mod:`megatron_ring_lab`: nothing in the library imports it. Parts: :mod:`.cli` (the command),
:mod:`.shrink` (toy model with the same structure), :mod:`.run` (one torchrun per CP size), :mod:`.entry` and
:mod:`.capture` (inside each run: what is recorded), :mod:`.compare` (rows with derived fp32 bounds),
:mod:`.causes` (likely causes), :mod:`.report` (table, JSON), :mod:`.static` (``--static`` preflight).
See docs/doctor.md.
"""
