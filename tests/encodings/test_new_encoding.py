"""The change scenario "a new weight-free encoding": its module, its config and a test, no edit to any other file.

The module is written into a temporary folder added to the ``voxdiff.encodings`` package's search path (as a file
``src/voxdiff/encodings/mirror.py`` would be found), its config into a temporary copy of ``configs/``
(``VOXDIFF_CONFIG_DIR``) as ``configs/encoding/mirror.yaml``. Nothing registers it: the config's ``_target_``
names the class, and every rule the rest of voxdiff applies comes from the class (label, factor, channels).
"""

import shutil
import sys
import textwrap

import pytest
import torch
import voxdiff.encodings
from voxdiff.cli.train import train, validate
from voxdiff.config import build_encoding, compose, config_dir, shapes
from voxdiff.errors import ConfigError
from voxdiff.preflight.check import static_problems

#: the new module, as a user would write it: space-to-depth with the block order mirrored and the sign flipped
MODULE = '''
"""Mirrored space-to-depth: each f×f×f block folded into channels in reverse order, negated. Lossless."""

import torch
from einops import rearrange

from voxdiff.encodings.base import Encoding


class MirroredSpaceToDepth(Encoding):
    """``(B, C, D, H, W)`` → ``(B, C·f³, D/f, H/f, W/f)``; channel order (c, k, j, i), values negated."""

    lossless = True
    label = "the mirrored S2D encoding"

    def __init__(self, factor: int = 2) -> None:
        super().__init__()
        self.factor = factor

    def encoded_channels(self, in_channels: int) -> int:
        return in_channels * self.factor**3

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        f = self.factor
        return -rearrange(x, "b c (d i) (h j) (w k) -> b (c k j i) d h w", i=f, j=f, k=f)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        f = self.factor
        return rearrange(-z, "b (c k j i) d h w -> b c (d i) (h j) (w k)", i=f, j=f, k=f)
'''

CONFIG = """# mirrored space-to-depth: lossless; (C, D, H, W) -> (C*f^3, D/f, H/f, W/f)
_target_: voxdiff.encodings.mirror.MirroredSpaceToDepth
factor: 2
"""


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """The new encoding's two files, in a package folder and a config folder of their own."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "mirror.py").write_text(textwrap.dedent(MODULE))
    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    (configs / "encoding" / "mirror.yaml").write_text(CONFIG)
    monkeypatch.setattr(voxdiff.encodings, "__path__", [*voxdiff.encodings.__path__, str(package)])
    monkeypatch.delitem(sys.modules, "voxdiff.encodings.mirror", raising=False)
    monkeypatch.setenv("VOXDIFF_CONFIG_DIR", str(configs))
    yield
    sys.modules.pop("voxdiff.encodings.mirror", None)


def test_it_is_built_from_its_config_and_round_trips(mirror):
    encoding = build_encoding(compose("train", ["experiment=demo", "encoding=mirror"]))
    assert type(encoding).__module__ == "voxdiff.encodings.mirror" and encoding.factor == 2
    x = torch.rand(2, 1, 8, 12, 16)
    z = encoding.encode(x)
    assert z.shape == (2, 8, 4, 6, 8)
    # channel c·8 + k·4 + j·2 + i of block (d, h, w) holds −x[c, 2d + i, 2h + j, 2w + k]
    assert torch.equal(z[:, 1, 1, 2, 3], -x[:, 0, 3, 4, 6]) and torch.equal(z[:, 4, 1, 2, 3], -x[:, 0, 2, 4, 7])
    assert torch.equal(encoding.decode(z), x)


def test_the_static_rules_use_its_label_factor_and_channels(mirror):
    cfg = compose("train", ["experiment=demo", "encoding=mirror"])
    assert static_problems(cfg) == []
    assert shapes(cfg).unet_input == (16, 16, 24, 24)  # image ⊕ mask, 8 channels each (32×48×48 → 16×24×24)
    bad = compose("train", ["experiment=demo", "encoding=mirror", "data.volume_shape=[48,64,63]"])
    with pytest.raises(ConfigError, match="the width 63 is not divisible by the MirroredSpaceToDepth factor 2"):
        validate(bad)
    deep = compose("train", ["experiment=demo", "encoding=mirror", "data.volume_shape=[44,64,64]"])
    assert any("depth 22 of the mirrored S2D encoding (22×32×32) is not divisible by 4" in str(p)
               for p in static_problems(deep))
    other = compose("train", ["experiment=demo"])
    other.encoding._target_ = "torch.nn.Identity"
    with pytest.raises(ConfigError, match=r"encoding=haar\|identity\|mirror\|s2d\|vqvae_4x\|vqvae_8x"):
        build_encoding(other)  # the refusal lists it among configs/encoding/*.yaml


def test_one_cpu_training_step_on_it(mirror, tmp_path):
    out = tmp_path / "run"
    cfg = compose("train", [
        "experiment=demo", "encoding=mirror", "logger=csv", f"paths.output_dir={out}",
        "data.volume_shape=[16,16,16]", "data.num_subjects=3", "model.channels=[8,8,8]",
        "model.num_res_blocks=1", "model.num_head_channels=8", "model.norm_num_groups=4",
        "system.sampling.num_masks=1", "system.sampling.num_inference_steps=2", "trainer.accelerator=cpu",
        "trainer.fast_dev_run=true", "trainer.enable_model_summary=false", "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
    ])
    report = train(cfg)
    loss = report["metrics"]["train/loss"]
    assert loss == loss and loss > 0 and "val/loss" in report["metrics"]  # a finite, real loss
    assert len(list((out / "samples").glob("*.png"))) == 1  # sampled and decoded through it
