"""Reference solutions to lesson 14's exercises (hiding the all-reduce). Try them yourself first."""


def exposed_seconds(op_seconds, bucket_ops, ring_seconds):
    """Bucket b is ready when its last op ends; its ring starts when it is ready and the ring
    before it has ended; exposed is what the last ring runs past backward's end."""
    now, ring_end, done_ops = 0.0, 0.0, 0
    ready = []
    for seconds in op_seconds:
        now += seconds
        ready.append(now)
    for ops, seconds in zip(bucket_ops, ring_seconds):
        done_ops += ops
        ring_end = max(ring_end, ready[done_ops - 1]) + seconds
    return max(0.0, ring_end - now)


def plan_buckets(sizes, bucket_bytes, itemsize):
    """From the last parameter to the first; a new bucket when the next parameter would take the
    current one over bucket_bytes (a parameter larger than that fills one alone)."""
    buckets, current, elements = [], [], 0
    for index in reversed(range(len(sizes))):
        if current and (elements + sizes[index]) * itemsize > bucket_bytes:
            buckets.append(current)
            current, elements = [], 0
        current.append(index)
        elements += sizes[index]
    if current:
        buckets.append(current)
    return buckets
