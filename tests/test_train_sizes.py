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
