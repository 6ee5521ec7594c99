"""Shipped data and the batch order: a pure function of seed, step and batch size."""

import numpy as np
import pytest

from minimp.data import Dataset, global_batch_indices, load_digits


def test_digits_ship_with_the_package():
    data = load_digits()
    assert data.train_images.shape == (1437, 64) and data.test_images.shape == (360, 64)
    assert data.classes == 10 and 0.0 <= data.train_images.min() and data.train_images.max() <= 1.0


def test_batches_depend_only_on_seed_step_and_batch_size():
    first = [global_batch_indices(0, step, 64, 1437) for step in range(1, 50)]
    again = [global_batch_indices(0, step, 64, 1437) for step in range(1, 50)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], global_batch_indices(1, 1, 64, 1437))


def test_each_epoch_visits_distinct_samples():
    epoch = np.concatenate([global_batch_indices(0, step, 100, 1437) for step in range(1, 15)])
    assert len(np.unique(epoch)) == len(epoch) == 1400


def test_batch_larger_than_the_dataset_is_an_error():
    with pytest.raises(ValueError, match="must lie in 1..1437"):
        global_batch_indices(0, 1, 2000, 1437)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.train_images.__setitem__((0, 0), np.nan), "hold inf or NaN"),
        (lambda d: d.test_images.__setitem__((1, 2), np.inf), "hold inf or NaN"),
        (lambda d: d.train_labels.__setitem__(3, -1), "integers >= 0"),
    ],
)
def test_data_that_cannot_train_is_refused_when_loaded(change, message):
    digits = load_digits()
    change(digits)
    with pytest.raises(ValueError, match=message):
        Dataset(**vars(digits))


def test_the_shapes_the_flags_check_match_the_data():
    from minimp.train.config import DATASET_SHAPES

    digits = load_digits()
    assert DATASET_SHAPES["digits"] == (digits.features, digits.classes)
