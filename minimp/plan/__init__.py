"""The grid planner: which dp x tp x pp, ZeRO stage, micro-batches and recomputation to use."""
