"""Print the bytes per parameter the trainer holds between steps, by kind, for each recipe.

    python scripts/memory_per_parameter.py       # the shakespeare GPT, about a minute

One step of the shakespeare GPT (its default config, one process, one evaluation batch) per
recipe; the bytes are `model_state_by_kind` of the run's metrics divided by the parameter count
(docs/low-precision.md's memory table; tests/test_memory_table.py checks them against the formula).
"""

import argparse

from minimp import distributed as dist
from minimp.train import TrainConfig, train
from minimp.train.fp8 import RECIPE_FLAGS

RECIPES = {**RECIPE_FLAGS, "bf16, no masters": dict(precision="bf16", master_weights="none")}
KINDS = ("parameters", "accumulators", "masters", "optimizer_state", "buffers")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print("| recipe | count | " + " | ".join(KINDS) + " | total |")
    print("|---|---|" + "---|" * (len(KINDS) + 1))
    for name, flags in RECIPES.items():
        config = TrainConfig(dataset="shakespeare", steps=1, eval_batches=1, log_every=1000,
                             **flags)  # type: ignore[arg-type]
        config.validate(1)
        result = dist.simulate(1, lambda comm: train(config, log=lambda line: None, comm=comm))[0]
        count = sum(weight.size for weight in result["master_weights"].values())
        held = result["model_state_by_kind"][0]
        cells = " | ".join(f"{held[kind] / count:g}" for kind in KINDS)
        print(f"| {name} | {count:,} | {cells} | {sum(held.values()) / count:g} |", flush=True)


if __name__ == "__main__":
    main()
