import numpy as np
import pytest
import pywt
import torch

from voxdiff.encodings import SUBBANDS, HaarWavelet
from voxdiff.errors import ConfigError


def test_channel_order_is_pywt_key_order():
    assert list(SUBBANDS) == sorted(pywt.dwtn(np.zeros((2, 2, 2)), "haar"))


@pytest.mark.parametrize("channels", [1, 3])
def test_coefficients_equal_pywavelets_for_every_subband(channels):
    x = torch.randn(2, channels, 8, 6, 10, dtype=torch.float64)
    z = HaarWavelet().encode(x)
    assert z.shape == (2, 8 * channels, 4, 3, 5)
    ref = pywt.dwtn(x.numpy(), "haar", axes=(-3, -2, -1))
    for band, key in enumerate(SUBBANDS):
        np.testing.assert_allclose(z[:, band::8].numpy(), ref[key], rtol=0, atol=1e-12, err_msg=key)


def test_inverse_reconstructs_fp32():
    x = torch.randn(2, 2, 16, 12, 8)
    enc = HaarWavelet()
    assert (enc.decode(enc.encode(x)) - x).abs().max().item() <= 1e-6


def test_inverse_matches_pywavelets_idwtn():
    x = torch.randn(1, 1, 4, 4, 4, dtype=torch.float64)
    coeffs = {k: np.random.default_rng(0).standard_normal((1, 1, 2, 2, 2)) for k in SUBBANDS}
    z = torch.cat([torch.from_numpy(coeffs[k]) for k in SUBBANDS], dim=1)
    ref = pywt.idwtn(coeffs, "haar", axes=(-3, -2, -1))
    np.testing.assert_allclose(HaarWavelet().decode(z).numpy(), ref, atol=1e-12)
    assert x.shape == HaarWavelet().decode(HaarWavelet().encode(x)).shape


def test_orthonormal_keeps_noise_variance():
    torch.manual_seed(0)
    z = HaarWavelet().encode(torch.randn(1, 1, 32, 32, 32))
    assert abs(z.std().item() - 1.0) < 0.02


def test_low_pass_band_of_constant_volume():
    z = HaarWavelet().encode(torch.ones(1, 1, 4, 4, 4))
    assert torch.allclose(z[:, 0], torch.full((1, 2, 2, 2), 2.0**1.5))  # (1·8)/√8
    assert torch.allclose(z[:, 1:], torch.zeros(1, 7, 2, 2, 2), atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes_pass_through(dtype):
    x = torch.randn(1, 1, 4, 4, 4).to(dtype)
    z = HaarWavelet().encode(x)
    assert z.dtype == dtype
    assert (HaarWavelet().decode(z).float() - x.float()).abs().max() < 0.05


def test_odd_size_is_refused():
    with pytest.raises(ConfigError, match="height 7 is not divisible"):
        HaarWavelet().encode(torch.zeros(1, 1, 4, 7, 4))
