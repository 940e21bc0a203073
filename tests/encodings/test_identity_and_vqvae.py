import pytest
import torch

from voxdiff.encodings import Encoding, HaarWavelet, Identity, SpaceToDepth, VQVAELatent
from voxdiff.errors import ConfigError


def test_identity_round_trip():
    x = torch.randn(2, 1, 5, 6, 7)
    assert Identity().encode(x) is x
    assert Identity().encoded_shape((1, 5, 6, 7)) == (1, 5, 6, 7)


@pytest.mark.parametrize(
    "encoding,lossless,channels", [(Identity(), True, 1), (SpaceToDepth(2), True, 8), (HaarWavelet(), True, 8),
                                   (VQVAELatent(4, 4), False, 4)]
)
def test_interface(encoding, lossless, channels):
    assert isinstance(encoding, Encoding)
    assert encoding.lossless is lossless
    assert encoding.encoded_channels(1) == channels
    assert encoding.decoded_channels(2 * channels) == 2


@pytest.mark.parametrize("factor,expected", [(4, (4, 40, 64, 64)), (8, (4, 20, 32, 32))])
def test_vqvae_latent_shape_from_config_alone(factor, expected):
    assert VQVAELatent(factor=factor, latent_channels=4).encoded_shape((1, 160, 256, 256)) == expected


def test_vqvae_without_weights_says_what_to_do():
    with pytest.raises(RuntimeError, match="encoding.checkpoint"):
        VQVAELatent(4).encode(torch.zeros(1, 1, 8, 8, 8))


def test_vqvae_factor_must_be_power_of_two():
    with pytest.raises(ConfigError, match="encoding.factor=6"):
        VQVAELatent(factor=6)


def test_vqvae_indivisible_volume_names_axis():
    with pytest.raises(ConfigError, match="depth 20 is not divisible by the VQVAELatent factor 8"):
        VQVAELatent(factor=8).encoded_shape((1, 20, 32, 32))


def test_vqvae_shapes_need_no_weights_even_with_a_checkpoint_path():
    # a config that names a checkpoint on another machine still gives shapes (preflight, model factory)
    encoding = VQVAELatent(factor=8, latent_channels=4, checkpoint="/cluster/only/last.ckpt")
    assert encoding.encoded_shape((1, 160, 256, 256)) == (4, 20, 32, 32)
    assert encoding.autoencoder is None and list(encoding.state_dict()) == []
    with pytest.raises(ConfigError, match="encoding.checkpoint=/cluster/only/last.ckpt: no such file"):
        encoding.encode(torch.zeros(1, 1, 8, 8, 8))


def test_weights_sha256_is_the_identity_of_the_weights():
    from voxdiff.encodings.vqvae import weights_sha256

    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(1.0)}
    same = {"b": torch.tensor(1.0), "a": torch.arange(6.0).reshape(2, 3).clone()}
    assert weights_sha256(state) == weights_sha256(same)  # key order and storage do not matter
    assert weights_sha256(state) != weights_sha256({**state, "b": torch.tensor(1.0 + 1e-7)})
    assert weights_sha256(state) != weights_sha256({**state, "a": state["a"].reshape(3, 2)})
