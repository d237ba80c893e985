"""Process groups: the provider that registers the ring with ``parallel_state`` (:mod:`.provider`), the one
resolver of the group a call runs on (:mod:`.resolve`), and our dynamic-CP scheduler in Megatron's hybrid-CP
data path (:mod:`.dynamic_cp`)."""
