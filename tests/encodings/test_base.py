"""What every encoding brings itself (its label in messages), and how a config names one."""

import sys
import types

import pytest
import torch
from omegaconf import OmegaConf

from voxdiff.config import build_encoding, compose
from voxdiff.encodings import Encoding, HaarWavelet, Identity, SpaceToDepth
from voxdiff.errors import ConfigError
from voxdiff.preflight.check import static_problems


class Negate(Encoding):
    """A weight-free encoding defined outside voxdiff's modules: x -> -x, factor 1, no label of its own."""

    def encoded_channels(self, in_channels: int) -> int:
        return in_channels

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return -x

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return -z


def test_labels_name_what_the_unet_sees():
    assert SpaceToDepth(2).label == "the S2D encoding"
    assert HaarWavelet().label == "the Haar encoding"
    assert Identity().label == "the volume"
    assert Negate().label == "the Negate encoding"


def test_a_new_encoding_module_plugs_in_with_its_label_in_the_rules(monkeypatch):
    module = types.ModuleType("voxdiff.encodings.negate")
    Negate.__module__ = module.__name__
    module.Negate = Negate
    monkeypatch.setitem(sys.modules, module.__name__, module)
    cfg = compose("train", ["model=default_3d_5lvl", "data.volume_shape=[40,64,64]"])
    cfg.encoding = OmegaConf.create({"_target_": "voxdiff.encodings.negate.Negate"})
    assert isinstance(build_encoding(cfg), Negate)
    messages = [str(p) for p in static_problems(cfg)]
    assert any("of the Negate encoding" in m and "not divisible by 16" in m for m in messages), messages


def test_an_unknown_encoding_lists_the_config_files():
    cfg = compose("train")
    cfg.encoding = OmegaConf.create({"_target_": "torch.nn.Identity"})
    with pytest.raises(ConfigError, match=r"configs/encoding/\*\.yaml: encoding=haar\|identity\|s2d\|vqvae_4x\|vqvae_8x"):
        build_encoding(cfg)


def test_learned_encodings_implement_the_whole_protocol():
    from voxdiff.encodings import LearnedEncoding, VQVAELatent

    class Partial(LearnedEncoding):  # no weights_identity, latent_scale, ...
        def encoded_channels(self, in_channels: int) -> int:
            return in_channels

        def encode(self, x):
            return x

        def decode(self, z):
            return z

    with pytest.raises(TypeError, match="abstract"):
        Partial()
    assert isinstance(VQVAELatent(4, 4), LearnedEncoding) and VQVAELatent.lossless is False
    for weight_free in (SpaceToDepth(2), HaarWavelet(), Identity(), Negate()):
        assert not isinstance(weight_free, LearnedEncoding)
        assert weight_free.check_ready() is None  # needs nothing before a run
