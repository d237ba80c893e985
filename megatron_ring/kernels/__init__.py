"""Local block attention kernels returning the log-sum-exp (:mod:`.block`: CPU and CUDA kernels and
their selection) and the block-level model features that wrap or extend them (:mod:`.head_dim`,
:mod:`.sinks`, :mod:`.dropout`)."""
