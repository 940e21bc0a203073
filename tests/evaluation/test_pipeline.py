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
