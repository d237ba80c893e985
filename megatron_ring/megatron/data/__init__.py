"""The data side of CP: the batch split (:mod:`.batch`), documents and packed batches (:mod:`.documents`),
RoPE at the layout's positions (:mod:`.rope`, :mod:`.packed_rope`), the CP-aware loss (:mod:`.loss`) and MTP
loss normalization (:mod:`.mtp_loss`), one document of Megatron's hybrid-CP loop (:mod:`.hybrid_cp`)."""
