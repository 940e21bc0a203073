"""Lesion counts of masks and each volume's nearest training volume (``voxdiff.evaluation.lesions``), on masks whose
answers are known by construction."""

import math

import pytest
import torch
from voxdiff.evaluation.lesions import (MASK_THRESHOLD, lesion_table, nearest_similarity, population_head,
                                        similarity, size_histogram)

SHAPE = (12, 12, 12)


def _mask(*boxes, value=1.0):
    """A ``(1, 1, D, H, W)`` mask with ``value`` in each box ``((z0, z1), (y0, y1), (x0, x1))``."""
    m = torch.zeros(1, 1, *SHAPE)
    for (z0, z1), (y0, y1), (x0, x1) in boxes:
        m[0, 0, z0:z1, y0:y1, x0:x1] = value
    return m


def test_lesions_are_26_connected_components_of_the_mask_above_the_threshold():
    """Two cubes apart are two lesions; two voxels touching only at a corner are one (26-connectivity; 6-connectivity
    would count two); a soft blob below the threshold is none."""
    apart = _mask(((1, 3), (1, 3), (1, 3)), ((6, 9), (6, 9), (6, 9)))  # 8 + 27 voxels
    corner = _mask(((1, 2), (1, 2), (1, 2)), ((2, 3), (2, 3), (2, 3)))  # 2 voxels, one shared corner
    soft = _mask(((4, 6), (4, 6), (4, 6)), value=MASK_THRESHOLD - 0.1)  # 8 voxels at 0.4
    t = lesion_table(torch.cat([apart, corner, soft]))
    assert t.lesions.tolist() == [2, 1, 0] and t.voxels.tolist() == [35, 2, 0]
    assert t.outside.tolist() == [0, 0, 0] and len(t) == 3  # no head given: nothing counted outside
    assert t.sizes.tolist() == [8, 27, 2]  # each lesion's voxels, mask by mask; the soft blob is none


def test_lesion_sizes_fall_in_bands_of_powers_of_two():
    """Sizes 1, 2, 3, 4, 7, 8 and 27 voxels: bands [1, 2) ... [16, 32) hold 1, 2, 2, 1 and 1 of them (an exact power
    of two opens its band); no lesion gives one empty band."""
    h = size_histogram(torch.tensor([1.0, 2, 3, 4, 7, 8, 27], dtype=torch.float64))
    assert h == {"edges": [1, 2, 4, 8, 16, 32], "lesions": [1, 2, 2, 1, 1]}
    assert size_histogram(torch.zeros(0, dtype=torch.float64)) == {"edges": [1, 2], "lesions": [0]}
    empty = lesion_table(torch.zeros(2, 1, *SHAPE))
    assert empty.sizes.numel() == 0 and size_histogram(empty.sizes)["lesions"] == [0]


def test_lesion_voxels_outside_the_head_are_counted():
    head = torch.zeros(SHAPE, dtype=torch.bool)
    head[:, :, :6] = True  # the head is the half x < 6
    straddles = _mask(((1, 3), (1, 3), (4, 8)))  # 2·2·4 voxels, half of them at x >= 6
    assert lesion_table(straddles, head).outside.tolist() == [8]
    with pytest.raises(ValueError, match="head"):
        lesion_table(straddles, head[:6])
    with pytest.raises(ValueError, match=r"\(N, 1, D, H, W\)"):
        lesion_table(straddles[0])


def test_the_population_head_is_where_most_real_heads_are():
    """Three images whose bright box is the head: two of them cover a voxel the third does not; the population's head
    holds it (2 of 3 >= half), not the voxels only one covers."""
    images = torch.zeros(3, 1, 24, 24, 24)
    images[0, 0, 4:20, 4:20, 4:20] = 0.8
    images[1, 0, 4:20, 4:20, 4:20] = 0.8
    images[2, 0, 4:12, 4:20, 4:20] = 0.8
    head = population_head(images)
    assert head[16, 12, 12] and head[8, 12, 12]  # inside all three, inside two
    assert not head[1, 1, 1] and not head[22, 22, 22]


def test_dice_of_masks_and_pearson_of_images():
    a = _mask(((0, 4), (0, 4), (0, 4)))  # 64 voxels
    half = _mask(((0, 4), (0, 4), (0, 2)))  # 32 of them
    empty = torch.zeros_like(a)
    s = similarity(torch.cat([a, empty]), torch.cat([a, half, empty]), "dice")
    assert s[0].tolist() == pytest.approx([1.0, 2 * 32 / 96, 0.0])
    assert s[1].isnan().all()  # an empty mask has no nearness
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1, 1, *SHAPE, generator=g)
    r = similarity(x, torch.cat([x, 1 - x, 2 * x + 3, torch.full_like(x, 0.5)]), "pearson")
    assert r[0].tolist() == pytest.approx([1.0, -1.0, 1.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="measure"):
        similarity(x, x, "ssim")
    with pytest.raises(ValueError, match="volumes"):
        similarity(x, x[..., :6], "pearson")


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_the_nearest_training_volume_streamed_in_chunks_is_the_nearest_of_the_whole_set(chunk):
    """Any chunking of the training set gives each query the greatest similarity over all of it and the index of
    that volume in the whole set; an empty query mask gets NaN and -1; no training volume is refused."""
    g = torch.Generator().manual_seed(1)
    training = (torch.rand(7, 1, *SHAPE, generator=g) > 0.7).float()
    queries = torch.cat([training[4:5], (torch.rand(2, 1, *SHAPE, generator=g) > 0.7).float(), torch.zeros(1, 1,
                                                                                                           *SHAPE)])
    whole = similarity(queries, training, "dice")
    best, index, seen = nearest_similarity(queries, (training[i:i + chunk] for i in range(0, 7, chunk)), "dice")
    assert seen == 7 and index[0] == 4 and best[0] == 1.0  # a copy of training volume 4
    for q in (1, 2):
        assert best[q] == pytest.approx(float(whole[q].max())) and index[q] == int(whole[q].argmax())
    assert math.isnan(best[3]) and index[3] == -1
    with pytest.raises(ValueError, match="no volume"):
        nearest_similarity(queries, iter([]), "dice")
    with pytest.raises(ValueError, match="training volumes"):
        nearest_similarity(queries, iter([training[..., :6]]), "dice")
