"""The protocol of a benchmark's step worker: it reads commands on stdin, one a line, and answers
each with one JSON line on stdout, so a parent can time several libraries in alternating blocks.

    N        -> [s_1, ..., s_N]   the seconds of N steps, each timed to the end of its device work
    stats    -> {...}             the worker's own figures (GEMMs alone, peak memory)

Plain Python, so that a Python with PyTorch and without minimp can serve it
(torch_gpt_step.py); gpt_step_bench.py sends counts only, gpu_gpt_bench.py both.
"""

import json
import sys
import time


def timed_steps(step, synchronize, count):
    """The seconds of `count` steps, each from its call to the end of its queued device work."""
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def serve(step, synchronize=lambda: None, stats=dict, lines=None, out=None):
    """Answer every command read from `lines` (stdin) on `out` (stdout) until the input ends."""
    for line in lines if lines is not None else sys.stdin:
        command = line.strip()
        answer = stats() if command == "stats" else timed_steps(step, synchronize, int(command))
        print(json.dumps(answer), file=out if out is not None else sys.stdout, flush=True)


def refuse(reason, kind="unavailable", out=None):
    """What a worker that cannot run answers, once, before it exits: {kind: reason}, where kind
    is "unavailable" (no library or device) or "unsupported" (the library cannot do this)."""
    print(json.dumps({kind: reason}), file=out if out is not None else sys.stdout, flush=True)
