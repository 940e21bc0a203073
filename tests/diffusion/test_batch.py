"""Batch → encodings in model range (both modes, latent batches) and back; the encoded ranges DDIM clips to."""

import math

import pytest
import torch
from voxdiff.diffusion import decode_volume, encode_batch, encode_volume, encoded_range
from voxdiff.diffusion.batch import mask_loss_weights, per_sample_mses
from voxdiff.encodings import HaarWavelet, Identity, SpaceToDepth


def _batch(b=2, shape=(4, 8, 8)):
    g = torch.Generator().manual_seed(0)
    return {"image": torch.rand(b, 1, *shape, generator=g),
            "mask": (torch.rand(b, 1, *shape, generator=g) > 0.7).float()}


def test_bravo_encodes_image_and_mask_in_model_range():
    enc = SpaceToDepth(2)
    batch = _batch()
    x0, cond = encode_batch(enc, batch, "bravo")
    assert x0.shape == cond.shape == (2, 8, 2, 4, 4)
    torch.testing.assert_close(x0, enc.encode(batch["image"] * 2 - 1))
    assert set(cond.unique().tolist()) <= {-1.0, 1.0}  # mask {0, 1} → {-1, 1}


def test_seg_generates_the_mask_alone():
    x0, cond = encode_batch(SpaceToDepth(2), _batch(), "seg")
    assert cond is None and set(x0.unique().tolist()) <= {-1.0, 1.0}


def test_latent_batches_skip_the_encoder():
    class Refuses(Identity):
        def encode(self, x):
            raise AssertionError("encode must not be called for latent batches")

    z_img, z_mask = torch.randn(2, 4, 2, 2, 2), torch.randn(2, 4, 2, 2, 2)
    x0, cond = encode_batch(Refuses(), {"image_z": z_img, "mask_z": z_mask}, "bravo")
    assert torch.equal(x0, z_img) and torch.equal(cond, z_mask)
    x0, cond = encode_batch(Refuses(), {"mask_z": z_mask}, "seg")
    assert torch.equal(x0, z_mask) and cond is None


def test_missing_keys_and_bad_mode():
    with pytest.raises(KeyError, match="image"):
        encode_batch(Identity(), {"mask": torch.zeros(1, 1, 2, 2, 2)}, "bravo")
    with pytest.raises(ValueError, match="mode"):
        encode_batch(Identity(), _batch(), "both")


@pytest.mark.parametrize("enc", [SpaceToDepth(2), HaarWavelet(), Identity()], ids=type)
def test_decode_inverts_encode(enc):
    batch = _batch()
    image = decode_volume(enc, encode_volume(enc, batch["image"]), "image")
    torch.testing.assert_close(image, batch["image"], rtol=0, atol=1e-6)
    mask = decode_volume(enc, encode_volume(enc, batch["mask"]), "mask")
    assert torch.equal(mask, batch["mask"])  # thresholded at 0


def test_decode_clamps_images_and_thresholds_masks():
    z = torch.tensor([-3.0, -0.1, 0.1, 3.0]).view(1, 1, 1, 1, 4)
    assert decode_volume(Identity(), z, "image").flatten().tolist() == pytest.approx([0.0, 0.45, 0.55, 1.0])
    assert decode_volume(Identity(), z, "mask").flatten().tolist() == [0.0, 0.0, 1.0, 1.0]


def test_encoded_ranges():
    assert encoded_range(SpaceToDepth(2)) == pytest.approx(1.0)
    assert encoded_range(Identity()) == pytest.approx(1.0)
    assert encoded_range(HaarWavelet()) == pytest.approx(2 * math.sqrt(2))
    # the bound is attained: a constant volume of ones has a Haar low-pass of 2√2
    ones = torch.ones(1, 1, 2, 2, 2)
    assert HaarWavelet().encode(ones).abs().max() == pytest.approx(2 * math.sqrt(2))


def test_mask_loss_weights_pool_the_full_size_mask_onto_the_encodings_grid():
    """diffusion.mask_weight: an element of the encoding weighs 1 + w where its block touches the mask, else 1, for
    a volume batch (encoded here) and for a latent batch that carries its full-size mask."""
    mask = torch.zeros(1, 1, 4, 8, 8)
    mask[0, 0, 1, 2, 3] = 1.0  # one voxel: the 2×2×2 block (0, 1, 1) of a space-to-depth ×2 encoding
    batch = {"image": torch.rand(1, 1, 4, 8, 8), "mask": mask}
    x0, _ = encode_batch(SpaceToDepth(2), batch, "bravo")
    w = mask_loss_weights(batch, x0, 9.0)
    assert w.shape == (1, 1, 2, 4, 4)
    assert w[0, 0, 0, 1, 1] == 10.0 and float(w.sum()) == 10.0 + (w.numel() - 1)
    latent = {"image_z": torch.randn(1, 4, 1, 2, 2), "mask_z": torch.randn(1, 4, 1, 2, 2), "mask": mask}
    assert mask_loss_weights(latent, latent["image_z"], 1.0).shape == (1, 1, 1, 2, 2)
    with pytest.raises(ValueError, match="diffusion.mask_weight .* no"):
        mask_loss_weights({"image_z": latent["image_z"], "mask_z": latent["mask_z"]}, latent["image_z"], 1.0)


def test_weighted_mse_is_the_plain_one_without_a_mask_and_leans_on_the_masked_error():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 3, 2, 4, 4, generator=g), torch.randn(2, 3, 2, 4, 4, generator=g)
    ones = torch.ones(2, 1, 2, 4, 4)
    plain, weighted = per_sample_mses(pred, target, ones)
    torch.testing.assert_close(weighted, plain)
    torch.testing.assert_close(per_sample_mses(pred, target)[1], plain)  # no weights: the plain MSE
    w = ones.clone()
    w[:, :, 0, 0, 0] = 11.0
    err = (pred - target) ** 2
    expected = (err * w).sum(dim=(1, 2, 3, 4)) / (w.sum(dim=(1, 2, 3, 4)) * 3)
    plain_again, weighted = per_sample_mses(pred, target, w)
    torch.testing.assert_close(weighted, expected)
    torch.testing.assert_close(plain_again, plain)  # the plain figure does not depend on the weights
    torch.testing.assert_close(plain, err.mean(dim=(1, 2, 3, 4)))


# ---------------------------------------------------------------- a seg model's mask weight undone while sampling
def _block_masks(n: int, grid: tuple[int, int, int], factor: int, rate: float, seed: int) -> torch.Tensor:
    """``(n, 1, D, H, W)`` masks in {0, 1} whose every ``factor³`` block is lesion with probability ``rate``."""
    g = torch.Generator().manual_seed(seed)
    blocks = (torch.rand((n, 1, *grid), generator=g) < rate).float()
    for axis in (2, 3, 4):
        blocks = blocks.repeat_interleave(factor, dim=axis)
    return blocks


def _oracle(encoding, noisy_scale, rate: float, mask_weight: float):
    """The exact minimiser of the weighted loss for masks of independent all-or-nothing blocks, each lesion with
    probability ``rate`` (a model trained to convergence with ``diffusion.mask_weight``): ``model(x, timesteps=t)``
    predicting x₀. A block's encoding is ``±c`` (``c`` the encoding of an all-lesion block), so the noisy block's
    log-odds of lesion are ``2·a·<x, c>/σ²`` plus the prior's, and the weight multiplies the lesion odds by 1 + w."""
    c = encoding.encode(torch.ones(1, 1, encoding.factor, encoding.factor, encoding.factor))  # (1, C, 1, 1, 1)
    prior = math.log(rate / (1 - rate)) + math.log1p(mask_weight)

    def model(x, timesteps):
        a, sigma = noisy_scale(float(timesteps[0]))
        logit = 2 * a * (x * c).sum(dim=1, keepdim=True) / sigma**2 + prior  # (B, 1, d, h, w)
        return (2 * torch.sigmoid(logit) - 1) * c  # E_w[x0 | x]: the block's encoding times 2p − 1

    return model


@pytest.mark.parametrize("process_name", ["ddpm", "rflow"])
@pytest.mark.parametrize("enc", [Identity(), HaarWavelet()], ids=["identity", "haar"])
def test_undoing_the_mask_weight_draws_masks_at_the_data_rate(process_name, enc):
    """A converged mask model trained with mask_weight 10 predicts lesion odds 11x too high: sampled as it is it
    draws several times the real lesion rate; unweighted (what TrainStep.generate does for seg runs) it draws the
    data's rate. The model here is the weighted loss's exact minimiser for a known mask distribution."""
    from voxdiff.diffusion import build_process, diffusion_settings
    from voxdiff.diffusion.batch import unweighted_mask_prediction

    rate, weight, f = 0.05, 10.0, enc.factor
    settings = diffusion_settings({"process": process_name, "prediction_type": "sample", "num_inference_steps": 50,
                                   **({"timestep_transform": False} if process_name == "rflow" else {})})
    process = build_process(settings, clip_range=encoded_range(enc))
    if process_name == "ddpm":
        abar = process.alphas_cumprod.double()
        scale = lambda t: (float(abar[int(t)]) ** 0.5, float(1 - abar[int(t)]) ** 0.5)  # noqa: E731
    else:
        scale = lambda t: (1 - t / 1000, t / 1000)  # noqa: E731
    model = _oracle(enc, scale, rate, weight)
    grid = (8, 16, 16)
    real = _block_masks(4, grid, f, rate, seed=0).mean().item()
    drawn = {}
    for unweight in (False, True):
        x0_map = (lambda x0: unweighted_mask_prediction(x0, enc, weight)) if unweight else None
        z = process.sample(model, (4, enc.encoded_channels(1), *grid), generator=torch.Generator().manual_seed(1),
                           eta=0.0, x0_map=x0_map)
        drawn[unweight] = decode_volume(enc, z, "mask").mean().item()
    weighted_rate = rate * (1 + weight) / (1 + weight * rate)  # 0.367: the odds 11x
    assert drawn[False] > 4 * real and abs(drawn[False] - weighted_rate) < 0.1, drawn
    assert abs(drawn[True] - real) < 0.02, (drawn, real)


def test_unweighting_refuses_a_learned_encoding_and_keeps_what_is_certain():
    from voxdiff.diffusion.batch import unweighted_mask_prediction
    from voxdiff.encodings import VQVAELatent

    latent = object.__new__(VQVAELatent)  # only its kind matters: refused before anything is decoded
    with pytest.raises(ValueError, match="mask_weight=0"):
        unweighted_mask_prediction(torch.zeros(1, 3, 2, 2, 2), latent, 10.0)
    enc = HaarWavelet()
    certain = _block_masks(1, (2, 2, 2), 2, 0.5, seed=3) * 2 - 1  # blocks certain lesion or certain background
    z = enc.encode(certain)
    assert torch.allclose(unweighted_mask_prediction(z, enc, 20.0), z, atol=1e-5)  # p̂ 0 or 1 stays as it is
    half = enc.encode(torch.zeros(1, 1, 4, 4, 4))  # p̂ = 0.5 everywhere → p = 0.5 / (1 + 20 · 0.5) = 1/22
    back = decode_volume(enc, unweighted_mask_prediction(half, enc, 20.0), "image")  # (v + 1) / 2 = p
    assert torch.allclose(back, torch.full_like(back, 1 / 22), atol=1e-5)


def _signed_distance_oracle(mask, scale):
    """What :func:`mask_distance_map` should be, from MONAI's Euclidean distance transform (SciPy's on the CPU)."""
    import numpy as np
    from monai.transforms.utils import distance_transform_edt

    reach = math.ceil(4 * scale)
    out = []
    for m in mask.numpy() > 0.5:  # (1, D, H, W) each
        inside = distance_transform_edt(m)  # to the nearest background voxel
        outside = distance_transform_edt(~m) if m.any() else np.full(m.shape, np.inf)  # to the nearest lesion voxel
        signed = np.clip(np.where(m, inside - 0.5, 0.5 - outside), -(reach - 0.5), reach - 0.5)
        out.append(np.tanh(signed / scale) / np.tanh((reach - 0.5) / scale))
    return torch.from_numpy(np.stack(out)).float()


@pytest.mark.parametrize("scale", [0.5, 2.0, 3.3])
def test_mask_distance_map_is_the_tanh_of_the_euclidean_signed_distance(scale):
    from voxdiff.diffusion.batch import mask_distance_map

    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(3, 1, 12, 20, 26, generator=g) > 0.995).float()  # scattered lesion voxels, far and near
    mask[1, :, 3:9, 5:12, 4:20] = 1.0  # a large lesion: distances inside it too
    mask[1, :, :, :, 0:2] = 1.0  # touching the volume's edge (nothing beyond it counts, as in SciPy)
    mask[2] = 0.0  # an empty mask
    got = mask_distance_map(mask, scale)
    assert got.shape == mask.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, _signed_distance_oracle(mask, scale), rtol=0, atol=1e-5)
    assert torch.equal((got > 0).float(), mask)  # thresholded at 0 it is the mask again
    assert torch.equal(got[2], torch.full_like(got[2], -1.0))  # the empty mask is the binary one
    assert got.min() >= -1 and got.max() <= 1


def test_mask_distance_map_runs_on_meta_tensors_for_the_preflight():
    from voxdiff.diffusion.batch import mask_distance_map

    out = mask_distance_map(torch.zeros(2, 1, 8, 8, 8, device="meta"), 2.0)
    assert out.device.type == "meta" and out.shape == (2, 1, 8, 8, 8)


@pytest.mark.parametrize("enc", [SpaceToDepth(2), HaarWavelet(), Identity()], ids=type)
def test_a_mask_model_with_mask_sdf_scale_draws_the_distance_map_and_decodes_to_the_mask(enc):
    from voxdiff.diffusion.batch import mask_distance_map

    batch = _batch()
    x0, cond = encode_batch(enc, batch, "seg", mask_sdf_scale=2.0)
    assert cond is None
    torch.testing.assert_close(x0, enc.encode(mask_distance_map(batch["mask"], 2.0)))
    assert torch.equal(decode_volume(enc, x0, "mask"), batch["mask"])
    plain, _ = encode_batch(enc, batch, "seg")
    assert not torch.allclose(x0, plain)
    image, mask = encode_batch(enc, batch, "bravo", mask_sdf_scale=2.0)  # a bravo model's condition stays binary
    torch.testing.assert_close(mask, encode_volume(enc, batch["mask"]))


def test_a_distance_map_needs_the_full_size_mask_and_a_weight_free_encoding():
    from voxdiff.diffusion.batch import check_mask_sdf_scale
    from voxdiff.errors import ConfigError

    with pytest.raises(ValueError, match="mask_sdf_scale=null"):
        encode_batch(Identity(), {"mask_z": torch.zeros(1, 4, 2, 2, 2)}, "seg", mask_sdf_scale=2.0)
    assert check_mask_sdf_scale(None) is None and check_mask_sdf_scale(2) == 2.0
    for bad in (0, -1, 17, "2", True):
        with pytest.raises(ConfigError, match="diffusion.mask_sdf_scale"):
            check_mask_sdf_scale(bad)
    with pytest.raises(ConfigError, match="diffusion.mask_weight=20.*mask_sdf_scale=2"):
        check_mask_sdf_scale(2, mask_weight=20.0)


def test_channel_moments_are_each_channels_mean_and_spread_over_every_voxel_of_every_chunk() -> None:
    """Chunks of different batch sizes give the moments of their concatenation (the spread about the mean, not the
    RMS: a channel of constant −2.83 has spread 0 and RMS 2.83)."""
    from voxdiff.diffusion.batch import channel_moments

    g = torch.Generator().manual_seed(5)
    chunks = [torch.randn(b, 3, 4, 4, 4, generator=g) * torch.tensor([0.1, 1.0, 2.0]).view(1, 3, 1, 1, 1)
              + torch.tensor([-2.83, 0.0, 5.0]).view(1, 3, 1, 1, 1) for b in (1, 3, 2)]
    chunks.append(torch.full((1, 3, 4, 4, 4), -2.83))
    every = torch.cat(chunks).transpose(0, 1).reshape(3, -1).double()
    moments = channel_moments(iter(chunks))
    torch.testing.assert_close(torch.tensor(moments["mean"]), every.mean(dim=1).float())
    torch.testing.assert_close(torch.tensor(moments["spread"]), every.std(dim=1, unbiased=False).float())
    torch.testing.assert_close(torch.tensor(moments["rms"]), every.pow(2).mean(dim=1).sqrt().float())
    constant = channel_moments([torch.full((2, 1, 2, 2, 2), -2.83)])
    assert constant["spread"] == [0.0] and constant["rms"][0] == pytest.approx(2.83)
    with pytest.raises(ValueError, match="an encoding of 2 channels after ones of 3"):
        channel_moments([chunks[0], torch.zeros(1, 2, 4, 4, 4)])
    with pytest.raises(ValueError, match="no encodings"):
        channel_moments([])
