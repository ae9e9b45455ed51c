"""Planning: footprint, cost model, memory budget, chunking, autotuning, calibrated constants."""
