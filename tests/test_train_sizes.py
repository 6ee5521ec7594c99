"""The pre-run memory check under --cp (minimp/train/sizes.py): a rank sizes the activations of its
T/cp positions (and the ring's buffers), so a context that one process cannot hold fits when the
ranks split it; the estimate bounds what the trainer measures is in
test_train_context_parallel_metrics.py."""

import pytest

from minimp.checkpoints.errors import ConfigError
from minimp.train import TrainConfig
from minimp.train.sizes import check_memory

# A long context on a small model: one process's T x T softmax is 10 GiB of its 10.2.
LONG = dict(dataset="shakespeare", layers=2, hidden=32, heads=4, context=4096, batch_size=8,
            precision="fp32")
GIB = 2**30


@pytest.mark.parametrize("flags, ranks_on_this_node, available", [
    (dict(cp=2), 2, 1 * GIB),  # the ring keeps no T x T: both ranks in 1 GiB
    (dict(cp=2, cp_mode="ulysses", cp_layout="contiguous"), 1, 6 * GIB),  # half of T x T a rank
])  # fmt: skip
def test_a_context_that_fits_only_split_passes_with_cp_and_is_refused_without(
    flags, ranks_on_this_node, available
):
    config = TrainConfig(**LONG, **flags)
    config.validate(2)
    check_memory(config, ranks_on_this_node, available, world_size=2)
    with pytest.raises(ConfigError, match=r"GiB of activations.*\(lower --context"):
        check_memory(TrainConfig(**LONG), 1, available)


# The MoE sizes: the trainer's measured activations and parameters against the estimate.
MOE = dict(dataset="shakespeare", layers=1, hidden=16, heads=2, context=8, batch_size=4,
           steps=1, eval_every=0, log_every=1000, experts=4)


@pytest.mark.parametrize("flags", [
    dict(top_k=2, precision="fp32"), dict(top_k=4),  # fp16: the float32 router's share grows
    dict(experts=16, top_k=2, expert_hidden=8, precision="bf16")])  # fmt: skip
def test_the_mixtures_activations_stay_within_the_estimate_and_above_the_dense_mlps(flags):
    """K routed rows of H-wide experts per token: the dense GPT's 70 sbh would not hold them
    (top-2's measured peak is above it in float32), the MoE term does."""
    from minimp import distributed as dist
    from minimp.train import train
    from minimp.train.sizes import gpt_activation_bytes

    config = TrainConfig(**{**MOE, **flags})
    config.validate(1)
    result = dist.simulate(1, lambda comm: train(config, lambda line: None, comm=comm))[0]
    measured = result["history"][0]["peak_activation_bytes"]
    estimate = gpt_activation_bytes(config, config.batch_size)
    dense = gpt_activation_bytes(TrainConfig(**{**MOE, **flags, "experts": 0}), config.batch_size)
    assert measured <= estimate
    if flags.get("precision") == "fp32":
        assert measured > dense  # the term is needed


def test_with_ep_a_rank_counts_its_own_experts_and_every_expert_has_two_linears():
    """rank_layer_counts keeps E/ep experts a block (the others are freed once the model is cut:
    the trainer's model_state_by_kind is checked against the same count in test_train_moe.py);
    fp8's histories count 2 + 2E Linears a block (the router is float32)."""
    from minimp.train.sizes import (gpt_shape, layer_parameter_counts, linear_count,
                                    rank_layer_counts)

    one, split = TrainConfig(**MOE), TrainConfig(**MOE, ep=2, dp=2)
    whole, mine = layer_parameter_counts(one), rank_layer_counts(split)
    expert = 2 * 16 * 64 + 64 + 16
    assert gpt_shape(one).expert_parameters() == expert
    assert [w - m for w, m in zip(whole, mine)] == [0, 2 * expert, 0]
    assert linear_count(one) == 2 + 2 * 4
    assert linear_count(TrainConfig(**{**MOE, "experts": 0})) == 4
