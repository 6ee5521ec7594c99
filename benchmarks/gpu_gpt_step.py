"""The minimp side of gpu_gpt_bench.py: one GPT training step in one precision, on the GPU
(or the CPU, for tests), serving step_server.py's protocol on stdin.

    python benchmarks/gpu_gpt_step.py --precision fp16 --layers 6 --heads 6 --width 384 \
        --context 256 --batch 64 --dropout 0.2           (gpu_gpt_bench.py starts it)

The step is the training loop's: dropout masks of this step, forward, cross-entropy, the loss
scaled, backward, then mixed_precision_step (unscale, finite check, clip at norm 1, AdamW with
weight decay on the matrices). `stats` answers with the step's GEMMs alone (gpt_gemms.py,
through the array module's matmul in the dtypes minimp's matrix products read, CUDA events around
them) and, on a GPU, the peak bytes in use during one step (a CuPy memory hook reading the
memory pool after every allocation) and the bytes the pool holds.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

from minimp import backend
from minimp.models.gpt import GPTConfig
from minimp.ops.linalg import gemm_operand
from minimp.precision import ACTIVATION_DTYPES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_gemms import gpt_gemms  # noqa: E402
from gpt_step_bench import build_step  # noqa: E402
from step_server import refuse, serve  # noqa: E402


def gemms_alone_ms(config, batch, precision, repeats=10):
    """Median ms of the step's GEMMs back to back, each operand as minimp's products read it
    (gemm_operand: float16 as it is for 2-D products on a GPU, else widened to float32)."""
    xp = backend.current_device().xp
    rng = xp.random.default_rng(0)
    dtype = ACTIVATION_DTYPES[precision]
    sizes = (config.layers, config.heads, config.width, config.context, config.vocab_size, batch)
    operands = []
    for _, count, m, n, k, a_transposed, b_transposed in gpt_gemms(*sizes):
        a = rng.standard_normal((count, k, m) if a_transposed else (count, m, k), np.float32)
        b = rng.standard_normal((count, n, k) if b_transposed else (count, k, n), np.float32)
        a, b = (gemm_operand(x.astype(dtype)[0] if count == 1 else x.astype(dtype))
                for x in (a, b))
        operands.append((a.swapaxes(-1, -2) if a_transposed else a,
                         b.swapaxes(-1, -2) if b_transposed else b))
    times = []
    for _ in range(2 + repeats):  # two warm-ups
        backend.synchronize()
        start = time.perf_counter()
        if xp is not np:
            begin, end = xp.cuda.Event(), xp.cuda.Event()
            begin.record()
        for a, b in operands:
            xp.matmul(a, b)
        if xp is not np:
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(begin, end))
        else:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def peak_memory(step):
    """(peak bytes in use during one step, bytes CuPy's memory pool holds after it)."""
    import cupy

    pool = cupy.get_default_memory_pool()

    class PeakHook(cupy.cuda.MemoryHook):
        name = "peak"
        peak = 0

        def malloc_postprocess(self, **kwargs):
            self.peak = max(self.peak, pool.used_bytes())

    backend.synchronize()
    hook = PeakHook()
    hook.peak = pool.used_bytes()
    with hook:
        step()
        backend.synchronize()
    return hook.peak, pool.total_bytes()


def bf16_problem():
    """Why CuPy cannot hold bfloat16 arrays, or None where it can."""
    import cupy

    try:
        cupy.zeros(1, ACTIVATION_DTYPES["bf16"])
    except Exception as error:  # CuPy raises its own kinds for an unknown dtype
        return f"CuPy {cupy.__version__} has no bfloat16 arrays ({type(error).__name__}: {error})"
    return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=tuple(ACTIVATION_DTYPES), default="fp16")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    for name, default in (("vocab", 65), ("context", 256), ("layers", 6), ("heads", 6),
                          ("width", 384), ("batch", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads on the CPU")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        backend.use_device(args.device)
    except backend.DeviceError as error:
        return refuse(str(error))
    problem = bf16_problem() if args.device == "gpu" and args.precision == "bf16" else None
    if problem:
        return refuse(problem, kind="unsupported")
    config = GPTConfig(vocab_size=args.vocab, context=args.context, layers=args.layers,
                       heads=args.heads, width=args.width, dropout=args.dropout)
    limiter = backend.limit_cpu_threads(args.threads)  # noqa: F841  (kept alive to the end)
    with np.errstate(over="ignore"):  # fp16's first steps overflow until the scale settles
        step = build_step(config, args.batch, args.precision)
        step()  # warm-up (CuPy compiles its kernels here)

        def stats():
            figures = {}
            if args.device == "gpu":  # first: the GEMMs' operands would stay in the pool
                import cupy

                figures["cupy"] = cupy.__version__
                allocated, held = peak_memory(step)
                figures.update(peak_allocated_bytes=allocated, peak_reserved_bytes=held)
            figures["gemms_alone_ms"] = gemms_alone_ms(config, args.batch, args.precision)
            return figures

        serve(step, backend.synchronize, stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
