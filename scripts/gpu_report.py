"""Merge the logs of scripts/gpu_check.sh into one JSON file
(device, date, tests, benchmarks, training)."""

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
    with open(out_path, "w") as file:
        json.dump(report, file, indent=1)
    print(json.dumps({k: report[k] for k in ("device", "tests", "train_4_ranks")}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
