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


def _tiny_latent(**kwargs):
    from voxdiff.encodings.vqvae import Stage1Checkpoint, build_vqvae, vqvae_spec

    torch.manual_seed(0)
    spec = vqvae_spec(factor=4, latent_channels=4, channels=[8, 16], num_res_layers=1, num_embeddings=32)
    ae = build_vqvae(spec).eval()
    return ae, VQVAELatent(4, 4, **kwargs).attach(ae, Stage1Checkpoint("test", spec, {}, 0.5, "", (32, 64, 64)))


def test_windowed_decoding_agrees_with_whole_decoding():
    """encoding.window: decoding in overlapping, Gaussian-blended windows of half the latent per axis (overlap 0.5)
    gives the whole decode within the stated tolerance (an untrained decoder: mean |difference| below 0.1 of the
    decoded volume's standard deviation, correlation above 0.99; measured 0.036-0.08 and 0.992-0.997 for windows
    of 1/8 to 1/2 of the latent); a window as large as the latent is the whole decode, bit for bit."""
    _, whole = _tiny_latent()
    _, split = _tiny_latent(window=[4, 8, 8])
    _, unsplit = _tiny_latent(window=[8, 16, 16])
    z = whole.encode(torch.rand(2, 2, 32, 64, 64, generator=torch.Generator().manual_seed(1)))  # (2, 8, 8, 16, 16)
    a, b = whole.decode(z), split.decode(z)
    assert b.shape == a.shape == (2, 2, 32, 64, 64)
    assert float((a - b).abs().mean()) < 0.1 * float(a.std())
    assert float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) > 0.99
    assert torch.equal(unsplit.decode(z), a)


def test_windowed_encoding_gives_codebook_vectors():
    """Encoding in windows blends the encoder's continuous output and quantises afterwards: every latent vector is
    still a codebook vector (times the latent scale), at the whole encode's shape."""
    ae, split = _tiny_latent(window=[4, 8, 8])
    z = split.encode(torch.rand(1, 2, 32, 64, 64, generator=torch.Generator().manual_seed(2)))
    assert z.shape == (1, 8, 8, 16, 16)
    codebook = ae.quantizer.quantizer.embedding.weight * 0.5  # (num_embeddings, k) × the latent scale
    vectors = z.reshape(1, 2, 4, -1).permute(0, 1, 3, 2).reshape(-1, 4)  # every (modality, voxel)'s k-vector
    nearest = torch.cdist(vectors, codebook).min(dim=1).values
    assert float(nearest.max()) < 1e-5


@pytest.mark.parametrize("key,kwargs", [("encoding.window", {"window": [0, 8, 8]}),
                                        ("encoding.window", {"window": [8, 8]}),
                                        ("encoding.window_overlap", {"window": [4, 8, 8], "window_overlap": 1.0})])
def test_bad_windows_are_refused(key, kwargs):
    with pytest.raises(ConfigError) as err:
        VQVAELatent(4, 4, **kwargs)
    assert err.value.key == key
