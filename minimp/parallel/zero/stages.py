"""ZeRO's stages by name: what each one shards over the replicas, as a policy the rest asks.

ZeRO's paper numbers its stages; FSDP and torchtitan name what they shard instead. minimp keeps
the numbers (they are the --zero flag) and asks the named facts everywhere outside
minimp/parallel/zero/: no other file of the library compares a stage number, but the planner's
cost terms (minimp/plan/), which price each stage by its paper's number:

  stage  optimizer state and masters  float32 gradients  compute copies (parameters)
  0      whole on every replica       whole              whole   (plain data parallelism)
  1      1/N each                     whole              whole
  2      1/N each                     1/N each           whole
  3      1/N each                     1/N each           1/N, gathered around each layer
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroStage:
    """One row of the table above. number: the stage (the --zero flag); shards_optimizer_state:
    the optimizer's slots and the float32 masters are 1/N per replica; shards_gradients: the
    float32 gradient sums too, each replica keeping only its chunks; shards_parameters: the
    compute copies too, gathered just before each layer runs."""

    number: int
    shards_optimizer_state: bool
    shards_gradients: bool
    shards_parameters: bool

    def __str__(self) -> str:
        return f"ZeRO stage {self.number}"


STAGES = (
    ZeroStage(0, False, False, False),
    ZeroStage(1, True, False, False),
    ZeroStage(2, True, True, False),
    ZeroStage(3, True, True, True),
)


def zero_stage(number: int | ZeroStage) -> ZeroStage:
    """The stage --zero names (a ZeroStage is its own); ValueError for a number ZeRO has
    no stage for."""
    if isinstance(number, ZeroStage):
        return number
    if isinstance(number, bool) or number not in range(len(STAGES)):
        raise ValueError(f"--zero must be 0, 1, 2 or 3 (ZeRO's stages), got {number}")
    return STAGES[int(number)]
