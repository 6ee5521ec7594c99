"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards what it replicates, stage by stage:
the optimizer state and masters (1), the gradients too (2), the parameters too (3)."""
