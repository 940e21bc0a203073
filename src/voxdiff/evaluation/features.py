"""Feature extractors for the distribution figures (Fréchet distance): volume ``(N, 1, D, H, W)`` in [0, 1] →
``(N, F)`` float64.

* :class:`RandomResNetFeatures`: MONAI's 3D ResNet-10 with weights drawn from a fixed seed (no download, the same
  network on every machine and torch version that draws the same numbers); the 512 global-average-pooled
  channels of its last stage. Not comparable to any published FID.
* :class:`VQVAEFeatures`: the encoder of the project's own stage-1 VQ-VAE (a checkpoint of ``train.py
  experiment=vqvae_*``); each encoder stage's output, global-average-pooled and concatenated. Not comparable to
  any published FID.
* :class:`MedicalNetFeatures`: MONAI's 3D ResNet with MedicalNet weights (Chen et al. 2019) from a file the user
  gives, checked against its SHA-256 and never downloaded; 512 (ResNet-10/18/34) or 2048 (ResNet-50+) pooled
  channels of the last stage. This is the feature extractor of the 3D FIDs that WDM (Friedrich et al. 2024) and
  HA-GAN (Sun et al. 2022) report.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from voxdiff.encodings.vqvae import build_vqvae, read_stage1_checkpoint
from voxdiff.errors import ConfigError
from voxdiff.files import load_file

#: MedicalNet ResNet depths MONAI builds
MEDICALNET_DEPTHS = (10, 18, 34, 50, 101, 152, 200)


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """SHA-256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _resnet(depth: int) -> torch.nn.Module:
    """MONAI's 3D ResNet of ``depth`` in MedicalNet's layout: 1 input channel, no classifier head."""
    from monai.networks.nets import resnet
    from monai.networks.nets.resnet import get_medicalnet_pretrained_resnet_args

    bias_downsample, shortcut_type = get_medicalnet_pretrained_resnet_args(depth)
    return getattr(resnet, f"resnet{depth}")(spatial_dims=3, n_input_channels=1, feed_forward=False,
                                             shortcut_type=shortcut_type, bias_downsample=bias_downsample)


class FeatureExtractor:
    """A frozen network mapping volumes to feature vectors, run in batches in fp32 on one device.

    Subclasses set ``name``, ``label`` (what the report prints) and ``network`` and may override
    :meth:`preprocess`.
    """

    name = "features"
    label = ""
    comparable = False  # whether figures on these features can be compared with published FIDs
    network: torch.nn.Module

    def preprocess(self, volumes: torch.Tensor) -> torch.Tensor:
        """``(N, 1, D, H, W)`` in [0, 1] → the network's input (default: mapped to [-1, 1])."""
        return volumes * 2.0 - 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    @torch.no_grad()
    def __call__(self, volumes: torch.Tensor, batch_size: int = 4, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(N, 1, D, H, W)`` → ``(N, F)`` float64 (on the CPU)."""
        self.network.to(device).eval()
        out = []
        for start in range(0, volumes.shape[0], batch_size):
            x = self.preprocess(volumes[start : start + batch_size].to(device, torch.float32))
            with torch.autocast(torch.device(device).type, enabled=False):
                out.append(self.forward(x).float().flatten(1).cpu().double())
        return torch.cat(out)


class RandomResNetFeatures(FeatureExtractor):
    """MONAI 3D ResNet-10 (MedicalNet's layout) with seeded random weights; 512 features.

    Args:
        seed: the seed its weights are drawn from (the global RNG is left as it was).
    """

    name = "random_resnet10"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.label = f"random 3D ResNet-10 (MONAI, seed {seed}): not comparable to published FIDs"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.network = _resnet(10).eval().requires_grad_(False)


class MedicalNetFeatures(FeatureExtractor):
    """MONAI 3D ResNet with MedicalNet weights from a local file, checked against its SHA-256.

    The file is a MedicalNet release (``{"state_dict": {"module.conv1.weight": ...}}``, segmentation head
    ``conv_seg.*`` ignored) or MONAI's conversion of it (a plain state dict). Inputs are standardised to zero
    mean, unit variance over each volume's non-zero voxels, as MedicalNet was trained.

    Args:
        weights: the ``.pth`` file.
        sha256: its expected SHA-256 (hex); a mismatch is refused.
        depth: the ResNet depth the file holds (10, 18, 34, 50, ...).
        zscore: standardise each volume over its non-zero voxels (MedicalNet's training); ``False`` feeds the
            volumes in [0, 1] as they are (as WDM's ``eval/fid.py`` does).

    Raises:
        ConfigError: no such file, a SHA-256 mismatch, an unknown depth or weights of another architecture (named
            as ``medicalnet.*``).
    """

    comparable = True

    def __init__(self, weights: str | Path, sha256: str, depth: int = 50, zscore: bool = True) -> None:
        path = Path(weights)
        if not path.is_file():
            raise ConfigError("medicalnet.weights", str(weights), "no such file",
                              "give the path of a MedicalNet resnet_<depth>.pth you downloaded yourself "
                              "(voxdiff never downloads), or medicalnet.weights=null")
        if depth not in MEDICALNET_DEPTHS:
            raise ConfigError("medicalnet.depth", depth, "not a MedicalNet ResNet depth",
                              f"use one of {', '.join(map(str, MEDICALNET_DEPTHS))}")
        actual = file_sha256(path)
        if not isinstance(sha256, str) or actual != sha256.strip().lower():
            raise ConfigError("medicalnet.sha256", sha256, f"{path} has SHA-256 {actual}",
                              "check that the file is the MedicalNet release you meant and pass its SHA-256 "
                              "(sha256sum FILE)")
        self.name = f"medicalnet_resnet{depth}"
        self.zscore = bool(zscore)
        self.label = f"MedicalNet ResNet-{depth} (sha256 {actual[:12]}…, inputs {'z-scored' if zscore else 'in [0, 1]'})"
        self.sha256 = actual
        self.network = _resnet(depth)
        state = load_file(path, "medicalnet.weights", "pass the MedicalNet resnet_<depth>.pth file itself")
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        own = self.network.state_dict()
        state = {k.removeprefix("module."): v for k, v in state.items()}
        state = {k: v for k, v in state.items() if k in own}  # drops MedicalNet's conv_seg head
        missing = sorted(set(own) - set(state))
        if missing:
            raise ConfigError("medicalnet.weights", str(path),
                              f"is not a MedicalNet ResNet-{depth}: {len(missing)} weights are missing "
                              f"(e.g. {missing[0]})", "set medicalnet.depth to the depth of the file")
        try:
            self.network.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ConfigError("medicalnet.weights", str(path), f"does not fit a ResNet-{depth}: "
                              f"{str(e).splitlines()[1] if len(str(e).splitlines()) > 1 else e}",
                              "set medicalnet.depth to the depth of the file") from None
        self.network.eval().requires_grad_(False)

    def preprocess(self, volumes: torch.Tensor) -> torch.Tensor:
        if not self.zscore:
            return volumes
        out = torch.empty_like(volumes)
        for i, v in enumerate(volumes):
            fg = v[v > 0]
            fg = fg if fg.numel() > 1 else v.reshape(-1)
            out[i] = (v - fg.mean()) / fg.std().clamp_min(1e-6)
        return out


class VQVAEFeatures(FeatureExtractor):
    """The encoder of a voxdiff stage-1 VQ-VAE: every encoder stage global-average-pooled and concatenated.

    Inputs stay in [0, 1], the range stage 1 was trained on.

    Args:
        checkpoint: a stage-1 checkpoint (``train.py experiment=vqvae_*``).
    """

    def __init__(self, checkpoint: str | Path) -> None:
        stage1 = read_stage1_checkpoint(checkpoint, key="stage1_ckpt")
        ae = build_vqvae(replace(stage1.spec, use_checkpoint=False))
        ae.load_state_dict(stage1.state)
        self.network = ae.encoder.eval().requires_grad_(False)
        self.name = "vqvae_encoder"
        self.label = f"voxdiff VQ-VAE {stage1.spec.factor}x encoder (sha256 {stage1.sha256[:12]}…): " \
                     "not comparable to published FIDs"
        self.sha256 = stage1.sha256

    def preprocess(self, volumes: torch.Tensor) -> torch.Tensor:
        return volumes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = []
        for block in self.network.blocks:
            x = block(x)
            pooled.append(x.mean(dim=(2, 3, 4)))
        return torch.cat(pooled, dim=1)


def build_extractors(random_seed: int | None, stage1_ckpt: str | None, medicalnet: dict[str, Any] | None
                     ) -> tuple[list[FeatureExtractor], dict[str, str]]:
    """The extractors a config asks for, and ``{name: why absent}`` for those it cannot have.

    Args:
        random_seed: seed of :class:`RandomResNetFeatures` (None: none).
        stage1_ckpt: a stage-1 checkpoint for :class:`VQVAEFeatures` (None: none).
        medicalnet: ``{"weights": path | None, "sha256": hex, "depth": int, "zscore": bool}``.
    """
    extractors: list[FeatureExtractor] = []
    absent: dict[str, str] = {}
    if random_seed is not None:
        extractors.append(RandomResNetFeatures(int(random_seed)))
    if stage1_ckpt:
        extractors.append(VQVAEFeatures(stage1_ckpt))
    else:
        absent["vqvae_encoder"] = "no stage-1 checkpoint given (stage1_ckpt=null)"
    medicalnet = medicalnet or {}
    if medicalnet.get("weights"):
        extractors.append(MedicalNetFeatures(medicalnet["weights"], medicalnet.get("sha256"),
                                             int(medicalnet.get("depth", 50)), bool(medicalnet.get("zscore", True))))
    else:
        absent["medicalnet"] = (
            "no MedicalNet weights file given (medicalnet.weights=null). voxdiff never downloads weights: fetch a "
            "MedicalNet resnet_<depth>.pth yourself and pass medicalnet.weights=FILE medicalnet.sha256=HEX "
            "medicalnet.depth=N to get the FID that WDM and HA-GAN report"
        )
    return extractors, absent

