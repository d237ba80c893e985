"""The ring engine: one forward ring and one backward ring driven by data (:mod:`.engine`), the fp32
log-sum-exp merge, sub-block streaming of a travelling block (:mod:`.rotation`), the buffer pool, the
in-band status carried with K/V (:mod:`.status`), input validation and the per-step timer."""
