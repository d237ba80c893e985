"""Moving bytes between ranks: the ring's point-to-point exchange (:mod:`.ring`), the collectives the
strategies use (:mod:`.collectives`), the CUDA stream seam, deadlines and failure notes."""
