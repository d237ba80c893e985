"""Local block attention kernels returning the log-sum-exp (:mod:`.block`: CPU and CUDA kernels and
their selection), masked blocks on a variable-length flash kernel (:mod:`.varlen_plan`: the host plan,
:mod:`.varlen`: the kernels) and the block-level model features that wrap or extend them (:mod:`.head_dim`,
:mod:`.sinks`, :mod:`.dropout`; on CUDA its fused kernels, :mod:`.dropout_triton`)."""
