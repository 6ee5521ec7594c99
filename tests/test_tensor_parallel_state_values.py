"""shard_selector, value by value: a rank's part of a whole checkpoint array, checked against
slices written out in NumPy, and the arrays it refuses, named by their shapes."""

import re

import numpy as np
import pytest

from minimp.parallel.tensor.checkpoint import shard_selector


def test_a_cut_parameter_gives_each_rank_its_slice_of_every_section():
    """Cut on axis 0 into 3 sections (q, k, v), each halved over 2 ranks: rank 1 takes rows
    2-3 of every 4-row section; anything not cut comes back as it is."""
    whole = np.arange(24.0).reshape(12, 2)
    select = shard_selector({"w": (0, 3)}, rank=1, ranks=2)
    expected = np.concatenate([whole[2:4], whole[6:8], whole[10:12]])
    np.testing.assert_array_equal(select("master/w", whole), expected)
    np.testing.assert_array_equal(select("optimizer/w/exp_avg", whole), expected)
    assert select("master/b", whole) is whole
    assert select("fp8/scales", whole) is whole


def test_an_array_without_the_cut_axis_is_refused_naming_its_shape():
    """Axis 1 of a 1-D array does not exist: the same error as a wrong length, not an IndexError."""
    select = shard_selector({"w": (1, 1)}, rank=0, ranks=2)
    message = "master/w has shape (4,), which does not split over --tp 2"
    with pytest.raises(ValueError, match=re.escape(message)):
        select("master/w", np.zeros(4))


def test_an_axis_that_does_not_divide_by_sections_times_ranks_is_refused():
    """One section over 2 ranks needs an even length: 3 rows are refused by name, before the cut
    (np.split's own error names no array)."""
    select = shard_selector({"w": (0, 1)}, rank=0, ranks=2)
    message = "master/w has shape (3, 2), which does not split over --tp 2"
    with pytest.raises(ValueError, match=re.escape(message)):
        select("master/w", np.zeros((3, 2)))
