"""Data parallelism: replicas of the whole model that average their gradients, bucket by bucket,
all at once after backward or overlapped with it."""
