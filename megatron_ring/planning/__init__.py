"""Planning on the host, apart from kernels and communication: the cost model of the comm types
(:mod:`.cost_model`, used by ``comm_type="auto"`` and the planner CLI) and the dynamic-CP scheduler
(:mod:`.dynamic_cp`: CP size and grouping per micro-batch of packed documents)."""
