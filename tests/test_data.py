"""Shipped data (digits, tiny shakespeare) and the batch order: a pure function of seed and step."""

import numpy as np
import pytest

from minimp.data import (
    Dataset,
    global_batch_indices,
    load_digits,
    load_shakespeare,
    text_batch,
)


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
    from minimp.train.sizes import DIGITS_SHAPE, SHAKESPEARE_VOCABULARY

    digits = load_digits()
    assert DIGITS_SHAPE == (digits.features, digits.classes)
    assert SHAKESPEARE_VOCABULARY == load_shakespeare().vocab_size


@pytest.fixture(scope="module")
def shakespeare():
    return load_shakespeare()


def test_shakespeare_ships_with_the_package_and_splits_90_10(shakespeare):
    import gzip
    import hashlib
    from importlib import resources

    packed = resources.files("minimp.datasets").joinpath("tinyshakespeare.txt.gz").read_bytes()
    text = gzip.decompress(packed)
    assert hashlib.sha256(text).hexdigest() == (  # the checksum minimp/datasets/README.md gives
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    )
    data = shakespeare
    assert data.vocab_size == 65 and data.vocabulary == "".join(sorted(set(data.vocabulary)))
    assert data.vocabulary[:3] == "\n !" and data.vocabulary[-1] == "z"
    assert (len(data.train), len(data.validation)) == (1_003_854, 111_540)
    assert data.decode(data.train[:14]) == "First Citizen:"


def test_encode_and_decode_are_inverse_and_refuse_unknown_characters(shakespeare):
    data = shakespeare
    ids = data.encode("To be, or not to be?\n")
    assert ids.dtype == np.int64 and data.decode(ids) == "To be, or not to be?\n"
    with pytest.raises(ValueError, match="'#' is not in the vocabulary"):
        data.encode("#1")


def test_text_batches_depend_only_on_seed_step_batch_size_and_context(shakespeare):
    train = shakespeare.train
    inputs, targets = text_batch(train, seed=0, step=3, batch_size=8, context=16)
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == np.int64
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # targets: the next character
    again = text_batch(train, seed=0, step=3, batch_size=8, context=16)
    assert np.array_equal(inputs, again[0]) and np.array_equal(targets, again[1])
    assert not np.array_equal(inputs, text_batch(train, 0, 4, 8, 16)[0])
    assert not np.array_equal(inputs, text_batch(train, 1, 3, 8, 16)[0])
