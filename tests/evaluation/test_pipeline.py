"""The evaluation's sampling batches and the noise each is drawn with (``voxdiff.evaluation.pipeline``)."""

import pytest
from voxdiff.evaluation.pipeline import batches, noise_batches


def test_without_a_cycle_every_batch_has_its_own_noise():
    assert noise_batches(5, 2) == [([0, 1], 0), ([2, 3], 1), ([4], 2)]
    assert [idx for idx, _ in noise_batches(7, 3)] == list(batches(7, 3))


def test_with_a_cycle_each_mask_gets_the_same_noise_in_every_cycle():
    """Three masks drawn twice (counterfactuals at two values), in batches of 2: no batch straddles two cycles, and
    sample i is drawn in the same place of a batch with the same key as sample i % 3."""
    plan = noise_batches(6, 2, cycle=3)
    assert plan == [([0, 1], 0), ([2], 1), ([3, 4], 0), ([5], 1)]
    place = {i: (key, idx.index(i), len(idx)) for idx, key in plan for i in idx}
    assert all(place[i] == place[i % 3] for i in range(6))
    with pytest.raises(ValueError, match="not a multiple"):
        noise_batches(7, 2, cycle=3)
