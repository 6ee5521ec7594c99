"""Merge the logs of scripts/gpu_check.sh into one JSON file
(device, date, tests, benchmarks, training), and print the GPT benchmark's table for docs/gpu.md."""

import datetime
import json
import os
import sys


def read_json(path):
    try:
        with open(path) as file:
            return json.loads(file.read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError) as error:
        return {"error": f"{os.path.basename(path)}: {error}"}


def main(logs, out_path):
    import cupy

    properties = cupy.cuda.runtime.getDeviceProperties(0)
    name = (
        properties["name"].decode() if isinstance(properties["name"], bytes) else properties["name"]
    )
    tests = open(os.path.join(logs, "tests.txt")).read().strip().splitlines()
    training = []
    if os.path.exists(os.path.join(logs, "train.jsonl")):
        training = [json.loads(line) for line in open(os.path.join(logs, "train.jsonl"))]
    steps = [r for r in training if "step" in r][20:]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "command": "bash scripts/gpu_check.sh",
        "tests": tests[-6:],
        "step_benchmark": read_json(os.path.join(logs, "step.json")),
        "step_profile": read_json(os.path.join(logs, "profile.json")),
        "ring_staged_2_ranks": read_json(os.path.join(logs, "ring2.json")),
        "allreduce_2_ranks": read_json(os.path.join(logs, "allreduce2.json")),
        "allreduce_4_ranks": read_json(os.path.join(logs, "allreduce4.json")),
        "train_4_ranks": {
            "test_accuracy": training[-1].get("test_accuracy") if training else None,
            "skipped_steps": sum(r["skipped"] for r in training if "step" in r),
            "median_step_seconds": sorted(
                r["compute_seconds"] + r["communication_seconds"] for r in steps
            )[len(steps) // 2]
            if steps
            else None,
        },
    }
    report["gpt_gpu_config"] = gpt_summary(os.path.join(logs, "gpt.jsonl"))
    report["gpt_step_benchmark"] = read_json(os.path.join(logs, "gpt_bench.json"))
    with open(out_path, "w") as file:
        json.dump(report, file, indent=1)
    print(json.dumps({k: report[k] for k in ("device", "tests", "train_4_ranks")}, indent=1))
    print("\n".join(gpt_bench_table(report["gpt_step_benchmark"])))



def gpt_bench_table(bench):
    """benchmarks/gpu_gpt_bench.py's figures as Markdown lines for docs/gpu.md (its own
    formatting), or the line saying why there are none."""
    if "variants" not in bench:
        return [f"GPT step benchmark: {bench.get('error', 'no figures')}"]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "benchmarks"))
    from gpu_gpt_bench import markdown

    return markdown(bench)

# nanoGPT's estimate of training FLOPs per token (PaLM appendix B): 6 N for the parameters' matrix
# products forward and backward, plus 12 L T C for attention's scores and weighted sums.
GPT_PARAMETERS = 65 * 384 + 256 * 384 + 6 * (12 * 384 * 384 + 13 * 384) + 2 * 384
GPT_FLOPS_PER_TOKEN = 6 * GPT_PARAMETERS + 12 * 6 * 256 * 384
H200_DENSE_FP16_FLOPS = 989e12  # NVIDIA's H200 SXM data sheet, dense (no sparsity)


def gpt_summary(path):
    """Loss reached, step rate, projected time of 5,000 steps, model FLOPs utilisation."""
    if not os.path.exists(path):
        return {"error": "no GPT metrics (the run did not start)"}
    rows = [json.loads(line) for line in open(path)]
    steps = [r for r in rows if "step" in r]
    if len(steps) < 20:
        return {"error": f"only {len(steps)} steps ran"}
    timed = steps[10:]
    seconds = sorted(r["compute_seconds"] + r["communication_seconds"] for r in timed)
    median = seconds[len(seconds) // 2]
    tokens_per_second = 64 * 256 / median
    evaluations = [(r["step"], r["val_loss"]) for r in steps if "val_loss" in r]
    return {
        "steps_run": steps[-1]["step"],
        "validation_losses": evaluations,
        "final_val_loss": rows[-1].get("val_loss") if "step" not in rows[-1] else None,
        "median_step_seconds": median,
        "tokens_per_second": tokens_per_second,
        "projected_seconds_for_5000_steps": 5000 * median,
        "model_flops_utilisation": tokens_per_second * GPT_FLOPS_PER_TOKEN / H200_DENSE_FP16_FLOPS,
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
