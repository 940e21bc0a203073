"""VQ-VAE latents: the lossy, learned encoding of latent diffusion (configs/encoding/vqvae_*.yaml).

The shapes and channel counts are known from the config alone (``factor``, ``latent_channels``), so preflight and
the model factory treat this encoding like the others before any weights exist. Encoding or decoding tensors needs
a trained stage-1 checkpoint (``encoding.checkpoint``), written by :class:`voxdiff.lightning.vqvae.VQVAESystem`.

The architecture is MONAI's 3D ``VQVAE`` (Tudosiu et al. 2022, https://arxiv.org/abs/2209.03177): one stride-2
convolution (kernel 4) per level, so ``factor = 2 ** len(channels)``, and an EMA codebook of ``latent_channels``-
dimensional vectors (van den Oord et al. 2017). :func:`vqvae_spec` validates its config and :func:`build_vqvae`
builds it; the stage-1 system and this encoding both build it from the same spec, which the checkpoint carries.

A stage-1 checkpoint also carries ``latent_scale``: 1/std of the quantised image latents of its last validation
epoch (the LDM scale factor, Rombach et al. 2022). :meth:`VQVAELatent.encode` returns ``latent_scale · q`` so the
diffusion sees roughly unit-variance inputs, and :meth:`VQVAELatent.decode` divides it out again before the
decoder. Because the scale lives with the weights, the checkpoint alone is enough to encode, decode and sample.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from einops import rearrange

from voxdiff.encodings.base import LearnedEncoding
from voxdiff.errors import ConfigError, boolean, int_list, integer, number
from voxdiff.files import load_file

#: (stride, kernel, dilation, padding) of each down-sampling convolution: halves even sizes exactly
DOWNSAMPLE = (2, 4, 1, 1)
#: (stride, kernel, dilation, padding, output padding) of each up-sampling transposed convolution: doubles sizes
UPSAMPLE = (2, 4, 1, 1, 0)
#: prefix of the autoencoder's weights in a stage-1 checkpoint's ``state_dict``
STATE_PREFIX = "vqvae."
#: key of the latent scale buffer in a stage-1 checkpoint's ``state_dict``
SCALE_KEY = "latent_scale"


@dataclass(frozen=True)
class VQVAESpec:
    """The validated architecture of one stage-1 VQ-VAE (single channel in and out)."""

    factor: int  # spatial compression per axis: 2 ** len(channels)
    latent_channels: int  # codebook vector size = channels of the latent (embedding_dim)
    channels: tuple[int, ...]  # channels per level, finest first; one stride-2 down-sampling per level
    num_res_layers: int  # residual units per level
    num_res_channels: tuple[int, ...]  # channels inside the residual units, per level
    num_embeddings: int  # codebook size
    commitment_cost: float  # weight of ||z - sg(q)||² in the VQ loss
    decay: float  # EMA decay of the codebook
    use_checkpoint: bool = False  # MONAI's activation checkpointing of the encoder and of the decoder

    @property
    def levels(self) -> int:
        return len(self.channels)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples) for ``save_hyperparameters`` and JSON."""
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def monai_kwargs(self) -> dict[str, Any]:
        return dict(
            spatial_dims=3,
            in_channels=1,
            out_channels=1,
            channels=self.channels,
            num_res_layers=self.num_res_layers,
            num_res_channels=self.num_res_channels,
            downsample_parameters=(DOWNSAMPLE,) * self.levels,
            upsample_parameters=(UPSAMPLE,) * self.levels,
            num_embeddings=self.num_embeddings,
            embedding_dim=self.latent_channels,
            commitment_cost=self.commitment_cost,
            decay=self.decay,
            use_checkpointing=self.use_checkpoint,
        )


def as_list(value: Any) -> Any:
    """Sequences (tuples, Hydra's ListConfig) → a plain list; anything else unchanged."""
    if isinstance(value, Sequence) and not isinstance(value, str) or type(value).__name__ == "ListConfig":
        return list(value)
    return value


def vqvae_spec(
    factor: int,
    latent_channels: int,
    channels: Sequence[int],
    num_res_layers: int = 2,
    num_res_channels: int | Sequence[int] | None = None,
    num_embeddings: int = 256,
    commitment_cost: float = 0.25,
    decay: float = 0.99,
    use_checkpoint: bool = False,
    key: str = "system.vqvae",
) -> VQVAESpec:
    """Validate a VQ-VAE config; every failure names the key (under ``key``), the value and a fix.

    Args:
        factor: spatial compression per axis (a power of two ≥ 2); must equal ``2 ** len(channels)``.
        latent_channels: latent channels (codebook vector size) per encoded volume channel.
        channels: channels per level, finest first.
        num_res_layers: residual units per level.
        num_res_channels: channels inside the residual units (an int for all levels, one per level, or
            ``None`` = ``channels``).
        num_embeddings: codebook size.
        commitment_cost: weight of the commitment term of the VQ loss.
        decay: EMA decay of the codebook, in (0, 1).
        use_checkpoint: MONAI's activation checkpointing (``use_checkpointing``) of the encoder and the decoder.
        key: the config node these values come from, for the error messages.
    """
    channels = as_list(channels)
    num_res_channels = as_list(num_res_channels)
    integer(f"{key}.factor", factor, minimum=1, example=4)
    if factor < 2 or factor & (factor - 1):
        raise ConfigError(f"{key}.factor", factor, "a VQ-VAE down-samples by stride-2 levels: a power of two ≥ 2",
                          "use 4 (encoding=vqvae_4x) or 8 (encoding=vqvae_8x)")
    levels = int(math.log2(factor))
    integer(f"{key}.latent_channels", latent_channels, minimum=1, example=4)
    example = [32 * 2**i for i in range(levels)]
    int_list(f"{key}.channels", channels, fix=f"one channel count per level, e.g. {key}.channels={example}")
    if len(channels) != levels:
        raise ConfigError(
            f"{key}.channels", list(channels),
            f"a factor-{factor} VQ-VAE has {levels} stride-2 levels (2^{levels} = {factor}), one entry each, "
            f"but {len(channels)} were given",
            f"give {levels} channel counts, e.g. {key}.channels={example}, or change encoding.factor to "
            f"{2 ** len(channels)}",
        )
    if num_res_channels is None:
        num_res_channels = list(channels)
    elif isinstance(num_res_channels, int) and not isinstance(num_res_channels, bool):
        num_res_channels = [num_res_channels] * levels
    int_list(f"{key}.num_res_channels", num_res_channels, length=levels,
             fix=f"a positive integer or {levels} of them (one per level), e.g. "
                 f"{key}.num_res_channels={list(channels)}")
    integer(f"{key}.num_res_layers", num_res_layers, minimum=0, example=2)
    integer(f"{key}.num_embeddings", num_embeddings, minimum=1, example=256)
    if num_embeddings < 2:
        raise ConfigError(f"{key}.num_embeddings", num_embeddings, "a codebook needs at least 2 vectors",
                          f"e.g. {key}.num_embeddings=256")
    number(f"{key}.commitment_cost", commitment_cost, lo=0, example=0.25)
    number(f"{key}.decay", decay, lo=0, hi=1, lo_open=True, hi_open=True, example=0.99)  # the codebook's EMA
    boolean(f"{key}.use_checkpoint", use_checkpoint, fix=f"set {key}.use_checkpoint=true to save activation memory")
    return VQVAESpec(
        factor=factor,
        latent_channels=latent_channels,
        channels=tuple(channels),
        num_res_layers=num_res_layers,
        num_res_channels=tuple(num_res_channels),
        num_embeddings=num_embeddings,
        commitment_cost=float(commitment_cost),
        decay=float(decay),
        use_checkpoint=use_checkpoint,
    )


def build_vqvae(spec: VQVAESpec) -> torch.nn.Module:
    """MONAI's ``VQVAE(spatial_dims=3, in_channels=1, out_channels=1, ...)`` of a validated spec.

    It maps ``(N, 1, D, H, W)`` to latents ``(N, latent_channels, D/f, H/f, W/f)`` and back; build it under
    ``torch.device("meta")`` to get shapes and parameter counts at no cost.
    """
    from monai.networks.nets import VQVAE

    return VQVAE(**spec.monai_kwargs())


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and values: a checkpoint's identity.

    Independent of everything else a Lightning checkpoint holds (optimizer state, loop counters), so two files
    with the same stage-1 weights have the same identity and a retrained ``last.ckpt`` a different one.
    """
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


@dataclass(frozen=True)
class Stage1Checkpoint:
    """What a stage-1 checkpoint holds that encoding needs."""

    path: str
    spec: VQVAESpec
    state: dict[str, torch.Tensor]  # the autoencoder's state dict (MONAI VQVAE keys)
    latent_scale: float  # latents are ``latent_scale · q``
    sha256: str  # :func:`weights_sha256` of the autoencoder weights and the scale
    volume_shape: tuple[int, ...] | None  # (D, H, W) it was trained on, if recorded


def read_stage1_checkpoint(path: str | Path, key: str = "encoding.checkpoint") -> Stage1Checkpoint:
    """Read a stage-1 checkpoint written by ``python train.py experiment=vqvae_4x`` (or vqvae_8x, vqvae_demo).

    Only tensors and plain data are unpickled (:func:`voxdiff.files.load_file`).

    Raises:
        ConfigError: no such file, unreadable, or not a voxdiff VQ-VAE checkpoint (named as ``key``).
    """
    path = Path(path)
    ckpt = load_file(path, key, "train stage 1 first (python train.py experiment=vqvae_4x) and pass its "
                     "<run dir>/checkpoints/last.ckpt")
    ckpt = ckpt if isinstance(ckpt, dict) else {}
    hparams = ckpt.get("hyper_parameters") or {}
    state = ckpt.get("state_dict") or {}
    if "vqvae" not in hparams or SCALE_KEY not in state:
        raise ConfigError(
            key, str(path),
            "is not a voxdiff VQ-VAE stage-1 checkpoint (no hyper_parameters.vqvae / latent_scale in it)",
            "point it at the checkpoints/last.ckpt of a run of python train.py experiment=vqvae_4x (or vqvae_8x)",
        )
    spec = vqvae_spec(**{k: v for k, v in dict(hparams["vqvae"]).items()}, key="system.vqvae")
    ae_state = {k[len(STATE_PREFIX):]: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
    scale = state[SCALE_KEY]
    shape = hparams.get("volume_shape")
    return Stage1Checkpoint(
        path=str(path),
        spec=spec,
        state=ae_state,
        latent_scale=float(scale),
        sha256=weights_sha256({**{STATE_PREFIX + k: v for k, v in ae_state.items()}, SCALE_KEY: scale}),
        volume_shape=tuple(int(s) for s in shape) if shape is not None else None,
    )


class VQVAELatent(LearnedEncoding):
    """Latents of a 3D VQ-VAE: ``(B, C, D, H, W)`` → ``(B, C·latent_channels, D/f, H/f, W/f)``.

    Each modality (image, mask) is encoded on its own by one shared single-channel VQ-VAE into
    ``latent_channels`` channels, so bravo mode sees ``2·latent_channels`` channels in and predicts
    ``latent_channels``. Channel ``c·latent_channels + k`` holds latent channel ``k`` of input channel ``c``.

    The latents are the *quantised* codebook vectors times the checkpoint's ``latent_scale`` (never the
    unquantised encoder output). The autoencoder is frozen and always in eval mode (its EMA codebook never
    updates here), and it is kept outside the module tree: it is not in this encoding's ``state_dict``, is not
    seen by optimizers or DDP, and follows the device of the tensors it is given.

    Implements :class:`~voxdiff.encodings.base.LearnedEncoding`: the weights are a stage-1 checkpoint
    (``encoding.checkpoint``), their identity is :func:`weights_sha256` of the autoencoder and the scale.

    Args:
        factor: spatial compression per axis (4 or 8 in the configs/encoding/vqvae_*.yaml).
        latent_channels: latent channels per encoded volume channel.
        checkpoint: path to a trained stage-1 checkpoint; needed only to encode or decode tensors, and read on
            first use (or by :meth:`load_weights`).
        window: encode and decode in overlapping windows of this many latent voxels ``[d, h, w]`` (``factor``
            times that in volume voxels; MONAI's ``sliding_window_inference``, Gaussian-weighted blending of the
            overlaps), so that a whole 160×256×256 volume holds one window's encoder or decoder activations instead
            of the volume's; None: the whole volume at once. An axis no longer than its window is not split.
            Encoding blends the encoder's continuous output and quantises it afterwards, so latents stay codebook
            vectors; decoding snaps to the codebook first, as whole decoding does.
        window_overlap: the windows' overlap, a fraction of the window in [0, 1).
    """

    @property
    def label(self) -> str:
        return f"the {self.factor}× latent"

    def __init__(self, factor: int = 4, latent_channels: int = 4, checkpoint: str | None = None,
                 window: Sequence[int] | None = None, window_overlap: float = 0.5) -> None:
        super().__init__()
        for key, value in (("encoding.factor", factor), ("encoding.latent_channels", latent_channels)):
            integer(key, value, minimum=1, fix=f"set {key} to e.g. 4")
        if factor & (factor - 1):
            raise ConfigError("encoding.factor", factor, "a VQ-VAE down-samples by powers of two",
                              "use encoding.factor=4 or 8")
        self.factor = factor
        self.latent_channels = latent_channels
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self.window: tuple[int, ...] | None = None
        self.window_overlap = 0.5
        self.use_window(window, window_overlap)
        # plain attributes (object.__setattr__): not registered as sub-modules, see the class docstring
        object.__setattr__(self, "_autoencoder", None)
        object.__setattr__(self, "_stage1", None)

    def use_window(self, window: Sequence[int] | None, overlap: float = 0.5) -> None:
        """Encode and decode in overlapping windows of ``window`` latent voxels ``[d, h, w]`` from now on (None: the
        whole volume), the windows overlapping by ``overlap`` (see the class docstring).

        Raises:
            ConfigError: a window that is not 3 positive integers, an overlap outside [0, 1).
        """
        self.window = None if window is None else int_list(
            "encoding.window", list(window) if not isinstance(window, str) else window,
            length=3, example=[10, 16, 16], fix="e.g. encoding.window=[10,16,16] (latent voxels d, h, w), or "
            "null to decode the whole volume at once")
        self.window_overlap = number("encoding.window_overlap", overlap, lo=0, hi=1, hi_open=True,
                                     fix="e.g. encoding.window_overlap=0.5")

    @classmethod
    def from_weights(cls, path: str, key: str = "encoding.checkpoint") -> VQVAELatent:
        """The encoding of a stage-1 checkpoint: its factor and latent channels (the autoencoder is built on first
        use)."""
        stage1 = read_stage1_checkpoint(path, key=key)
        encoding = cls(stage1.spec.factor, stage1.spec.latent_channels, checkpoint=str(path))
        object.__setattr__(encoding, "_stage1", stage1)
        return encoding

    @property
    def weights_path(self) -> str | None:
        return self.checkpoint

    @property
    def autoencoder(self) -> torch.nn.Module | None:
        """The frozen MONAI ``VQVAE``, or ``None`` before weights are loaded."""
        return self._autoencoder

    @property
    def stage1(self) -> Stage1Checkpoint | None:
        """What was read from the checkpoint (spec, scale, identity), or ``None`` before it was read."""
        return self._stage1

    @property
    def latent_scale(self) -> float:
        """Latents are ``latent_scale`` × the quantised codebook vectors (reads the checkpoint if needed)."""
        return self._read().latent_scale

    @property
    def weights_identity(self) -> str:
        """:func:`weights_sha256` of the autoencoder weights and the scale (reads the checkpoint if needed)."""
        return self._read().sha256

    @property
    def trained_volume_shape(self) -> tuple[int, ...] | None:
        return self._read().volume_shape

    def weights_record(self) -> dict[str, Any]:
        """The cache index's ``stage1``: path, identity, the architecture and the volume shape it was trained on."""
        stage1 = self._read()
        return {**super().weights_record(), "architecture": stage1.spec.as_dict(),
                "trained_volume_shape": list(stage1.volume_shape) if stage1.volume_shape else None}

    def encoded_channels(self, in_channels: int) -> int:
        return in_channels * self.latent_channels

    def _read(self) -> Stage1Checkpoint:
        """The stage-1 checkpoint (read once), checked against this encoding's factor and latent channels.

        Raises:
            RuntimeError: no checkpoint is named.
            ConfigError: the checkpoint is refused, or its factor or latent channels differ from this config.
        """
        if self._stage1 is not None:
            return self._stage1
        if self.checkpoint is None:
            raise RuntimeError(
                f"the vqvae encoding (factor {self.factor}) has no trained weights loaded "
                f"(encoding.checkpoint={self.checkpoint}); train stage 1 first and point encoding.checkpoint at it"
            )
        stage1 = read_stage1_checkpoint(self.checkpoint, key=self.weights_key)
        for key, mine, theirs in (("factor", self.factor, stage1.spec.factor),
                                  ("latent_channels", self.latent_channels, stage1.spec.latent_channels)):
            if mine != theirs:
                raise ConfigError(
                    f"encoding.{key}", mine,
                    f"the stage-1 checkpoint {self.checkpoint} was trained with {key} {theirs}",
                    f"set encoding.{key}={theirs} (encoding=vqvae_{stage1.spec.factor}x), or use a stage-1 "
                    f"checkpoint trained with {key} {mine}",
                )
        object.__setattr__(self, "_stage1", stage1)
        return stage1

    def load_weights(self, checkpoint: str | Path | None = None) -> VQVAELatent:
        """Read the stage-1 checkpoint (``checkpoint`` or ``self.checkpoint``) and build the frozen autoencoder.

        Raises:
            ConfigError: the checkpoint's factor or latent channels differ from this encoding's config.
        """
        if checkpoint is not None and str(checkpoint) != self.checkpoint:
            self.checkpoint = str(checkpoint)
            object.__setattr__(self, "_stage1", None)
        stage1 = self._read()
        ae = build_vqvae(VQVAESpec(**{**asdict(stage1.spec), "use_checkpoint": False}))  # inference only
        ae.load_state_dict(stage1.state)
        return self.attach(ae, stage1)

    def attach(self, autoencoder: torch.nn.Module, stage1: Stage1Checkpoint) -> VQVAELatent:
        """Encode and decode with ``autoencoder`` (a MONAI ``VQVAE`` of ``stage1.spec``; frozen and put in eval mode
        here) and ``stage1``'s latent scale. :meth:`load_weights` attaches a checkpoint's weights; the preflight one
        built on the meta device (:mod:`voxdiff.preflight.stage1`)."""
        autoencoder.eval().requires_grad_(False)
        object.__setattr__(self, "_autoencoder", autoencoder)
        object.__setattr__(self, "_stage1", stage1)
        return self

    def _require_weights(self, device: torch.device | None = None) -> torch.nn.Module:
        if self._autoencoder is None:
            self.load_weights()
        ae = self._autoencoder
        if device is not None and next(ae.parameters()).device != device:
            ae.to(device)
        ae.eval()
        return ae

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, D, H, W)`` → ``(B, C·latent_channels, D/f, H/f, W/f)``: ``latent_scale`` × quantised latents.

        Volumes are expected in the range stage 1 was trained on ([0, 1]); runs in fp32 even under autocast.
        """
        self._check_input(x)
        ae = self._require_weights(x.device)
        c = x.shape[1]
        flat = rearrange(x.float(), "b c d h w -> (b c) 1 d h w")  # each channel (modality) on its own
        with torch.autocast(x.device.type, enabled=False):  # fp32 always: the same codes as the latent cache
            window = None if self.window is None else [w * self.factor for w in self.window]  # in volume voxels
            # the encoder's output (blended over windows, if any), then quantised as a whole: (B·C, k, d, h, w)
            q = ae.quantize(windowed(ae.encode, flat, window, self.window_overlap))[0]
        return rearrange(q * self._stage1.latent_scale, "(b c) k d h w -> b (c k) d h w", c=c)

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """``(B, C·latent_channels, d, h, w)`` → ``(B, C, d·f, h·f, w·f)``.

        Divides out ``latent_scale``, snaps each latent vector to its nearest codebook vector (as VQ-VAE decoding
        does; a no-op for cached latents) and runs the decoder. Decoded volumes are not clamped.
        """
        ae = self._require_weights(z.device)
        k = self.latent_channels
        if z.dim() != 5 or z.shape[1] % k:
            raise ValueError(f"VQVAELatent.decode expects (B, C·{k}, d, h, w), got shape {tuple(z.shape)}")
        flat = rearrange(z.float() / self._stage1.latent_scale, "b (c k) d h w -> (b c) k d h w", k=k)
        with torch.autocast(z.device.type, enabled=False):
            x = windowed(ae.decode_stage_2_outputs, flat, self.window, self.window_overlap)  # (B·C, 1, D, H, W)
        return rearrange(x, "(b c) 1 d h w -> b c d h w", b=z.shape[0])

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={list(self.window)}"
        return f"factor={self.factor}, latent_channels={self.latent_channels}, checkpoint={self.checkpoint}{window}"


def windowed(network: Any, x: torch.Tensor, window: Sequence[int] | None, overlap: float) -> torch.Tensor:
    """``network`` run over overlapping windows of ``x (N, C, D, H, W)`` (``window`` voxels of ``x`` per axis, at
    most its size) and blended: MONAI's ``sliding_window_inference`` with Gaussian importance weights, whose output
    may be larger or smaller than its input (a decoder's, an encoder's: ``factor`` times per axis). One window at a
    time, on ``x``'s device. ``network(x)`` itself where ``window`` is None or no axis is longer than its window.

    The importance map is made on the CPU and moved to ``x``'s device: MONAI's own reads a value from it, which a
    meta tensor (the preflight's stand-in for a GPU) cannot give.
    """
    if window is None or all(s <= w for s, w in zip(x.shape[2:], window)):
        return network(x)
    from monai.data.utils import compute_importance_map  # deferred: MONAI's inferers are only needed for windows
    from monai.inferers import sliding_window_inference  # deferred: as above

    roi = tuple(min(int(w), int(s)) for w, s in zip(window, x.shape[2:]))
    weights = compute_importance_map(roi, mode="gaussian", device="cpu").to(x.device)
    return sliding_window_inference(x, roi_size=roi, sw_batch_size=1, predictor=network, overlap=overlap,
                                    mode="gaussian", roi_weight_map=weights, progress=False)
