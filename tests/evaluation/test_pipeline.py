"""The evaluation's sampling batches and the noise each is drawn with (``voxdiff.evaluation.pipeline``)."""

import math

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


def test_a_vqvae_s_reconstruction_figures_carry_their_intervals_and_its_codebook_counts_none():
    """Reconstructions of 6 volumes, each the image plus noise of its own strength: each reconstruction figure's
    interval holds its mean; the codebook figures, counts over every latent, have none."""
    import torch

    from voxdiff.evaluation.pipeline import VolumeSet, vqvae_figures
    from voxdiff.evaluation.uncertainty import Bootstrap

    g = torch.Generator().manual_seed(0)
    images = torch.rand(6, 1, 24, 24, 24, generator=g)
    recon = (images + torch.linspace(0.01, 0.2, 6).view(-1, 1, 1, 1, 1) * torch.randn(images.shape, generator=g))
    real = VolumeSet(images, torch.zeros_like(images), torch.eye(4).expand(6, 4, 4), [f"s{i}" for i in range(6)])
    codes = torch.randint(0, 8, (12, 3, 3, 3), generator=g)
    figures = vqvae_figures(real, recon.clamp(0, 1), codes, 8, bootstrap=Bootstrap(resamples=500))
    for name in ("reconstruction_ssim", "reconstruction_psnr", "reconstruction_ms_ssim"):
        low, high = figures[name]["ci"]
        assert low < figures[name]["value"] < high, name
    assert "ci" not in figures["codebook_perplexity"] and "ci" not in figures["codebook_dead_codes"]
    assert "ci" not in vqvae_figures(real, recon.clamp(0, 1), codes, 8)["reconstruction_psnr"]  # no bootstrap


@pytest.fixture(scope="module")
def phantom():
    """12 phantom subjects at 32×48×48: the first 8 the real set, the last 4 the training split."""
    import torch
    from voxdiff.data.phantom import PhantomDataset
    from voxdiff.evaluation.pipeline import VolumeSet

    ds = PhantomDataset((32, 48, 48), 12, cache=True)
    items = [ds[i] for i in range(12)]
    images = torch.stack([i["image"] for i in items]).float()
    masks = torch.stack([i["mask"] for i in items]).float()
    real = VolumeSet(images[:8], masks[:8], torch.eye(4).expand(8, 4, 4).double(), [f"s{i}" for i in range(8)])
    return real, images[8:], masks[8:]


def test_masks_drawn_like_the_real_ones_score_as_the_real_ones_and_misplaced_or_soft_ones_do_not(phantom):
    """Generated masks that are the real masks: every figure as the real one's (ratios 1, nothing outside the head);
    a lesion in the corner of the volume (outside every head), the masks cut by empty planes, or faded to 0.4
    (below the threshold): the figure that measures it moves, with its interval where a bootstrap is asked."""
    import torch
    from voxdiff.evaluation.pipeline import Drawn, mask_figures
    from voxdiff.evaluation.uncertainty import Bootstrap

    real, _, _ = phantom
    same = mask_figures(real.masks.clone(), real)
    for name in ("lesion_count", "lesion_load", "lesion_size"):
        assert same[f"{name}_generated"]["value"] == same[f"{name}_real"]["value"] > 0, name
        assert same[f"{name}_generated"]["ratio_to_real"] == 1.0
    assert same["lesion_outside_head_generated"]["value"] == 0
    assert same["lesion_count_real"]["per_mask"] == [int(v) for v in same["lesion_count_generated"]["per_mask"]]

    corner = torch.zeros_like(real.masks)
    corner[:, :, :3, :3, :3] = 1  # one lesion of 27 voxels, where no head is
    moved = mask_figures(corner, real)
    assert moved["lesion_outside_head_generated"]["value"] == 1.0 and moved["lesion_count_generated"]["value"] == 1
    assert moved["lesion_outside_head_real"]["value"] == 0.0

    split = real.masks.clone()
    split[:, :, :, :, ::2] = 0  # every other sagittal plane emptied: lesions fall apart into many
    assert mask_figures(split, real)["lesion_count_generated"]["value"] > 1.5 * same["lesion_count_real"]["value"]

    faded = mask_figures(real.masks * 0.4, real)
    assert faded["lesion_load_generated"]["value"] == 0 and math.isnan(faded["lesion_size_generated"]["value"])

    drawn = Drawn({"generated": 8, "real": 8}, Bootstrap(resamples=200))
    withci = mask_figures(real.masks.clone(), real, drawn)
    low, high = withci["lesion_load_generated"]["ci"]
    assert low < withci["lesion_load_generated"]["value"] < high
    assert {"lesion_count_generated", "lesion_size_real", "lesion_outside_head_generated"} <= set(drawn.resamplers)


@pytest.mark.parametrize("mode", ["seg", "bravo"])
def test_generated_volumes_that_copy_the_training_split_are_nearer_to_it_than_any_held_out_volume(phantom, mode):
    """Generated volumes that are copies of training volumes: each nearest to the one it copies, at similarity 1,
    all of them nearer than any held-out real volume (copies share 1); generated volumes that are held-out subjects'
    own: as near as the held-out ones (copies share 0)."""
    from voxdiff.evaluation.pipeline import nearest_figures

    real, train_images, train_masks = phantom
    training = train_masks if mode == "seg" else train_images
    chunks = [(training[:3], ["t0", "t1", "t2"]), (training[3:], ["t3"])]
    copies = nearest_figures(training[[2, 0]], real, mode, iter(chunks))
    g = copies["nearest_training_generated"]
    assert g["subjects"] == ["t2", "t0"] and g["value"] == pytest.approx(1.0) and g["training_volumes"] == 4
    assert g["measure"] == ("dice" if mode == "seg" else "pearson")
    assert copies["nearest_training_real"]["value"] < 0.95 and copies["nearest_training_copies"]["value"] == 1.0
    own = real.masks if mode == "seg" else real.images
    unseen = nearest_figures(own[:4].clone(), real, mode, iter(chunks))
    assert unseen["nearest_training_copies"]["value"] == 0.0
    assert unseen["nearest_training_generated"]["per_volume"] == unseen["nearest_training_real"]["per_volume"][:4]


def test_a_mask_models_denoising_is_scored_against_the_masks_it_was_shown(phantom):
    """A perfect denoiser returns every real mask (Dice 1, the lesion load 1×); one that returns nothing scores 0
    (an empty estimate of a real lesion counts, it is the failure the figure exists for); a real mask without a
    lesion is left out; half the lesion voxels returned: Dice 2/3, load 0.5×. The interval is over the real masks."""
    import torch
    from voxdiff.evaluation.pipeline import Drawn, VolumeSet, denoising_figures
    from voxdiff.evaluation.uncertainty import Bootstrap

    real, _, _ = phantom
    masks = real.masks.clone()
    masks[7] = 0  # a subject without lesion
    real = VolumeSet(real.images, masks, real.affines, real.subjects)
    halved = masks.clone()
    for m in halved:  # keep the first half of each mask's lesion voxels (in memory order)
        idx = m.reshape(-1).nonzero()[:, 0]
        m.view(-1)[idx[len(idx) // 2:]] = 0
    figures = denoising_figures({0.05: masks.to(torch.uint8), 0.2: torch.zeros_like(masks, dtype=torch.uint8),
                                 0.5: halved.to(torch.uint8)}, real,
                                Drawn({"generated": 0, "real": 8}, Bootstrap(resamples=200)))
    perfect, empty, half = (figures[f"denoised_dice_t{k}"] for k in ("05", "20", "50"))
    assert perfect["value"] == 1.0 and perfect["lesion_load_ratio"] == 1.0 and perfect["n"] == 7
    assert math.isnan(perfect["per_mask"][7]) and perfect["fraction"] == 0.05
    assert empty["value"] == 0.0 and empty["lesion_load_ratio"] == 0.0
    lesion = masks.flatten(1).sum(1)[:7]
    kept = (lesion // 2).double()  # the voxels the halved masks keep (odd counts keep the smaller half)
    assert half["value"] == pytest.approx(float((2 * kept / (lesion + kept)).mean()))
    assert half["lesion_load_ratio"] == pytest.approx(float(kept.sum() / lesion.sum()))
    low, high = half["ci"]
    assert low <= half["value"] <= high
    with pytest.raises(ValueError, match="are not the real ones"):
        denoising_figures({0.05: masks[:4]}, real)
