"""Build MONAI's 3D ``DiffusionModelUNet`` from a plain config, validated up front.

Two switches of the config decide how the model runs rather than what it computes, and both take ``auto``:
``use_flash_attention`` (SDPA instead of MONAI's materialised attention scores) and ``compile``
(``torch.compile`` of the training forward, :class:`voxdiff.step.TrainStep`). ``auto`` means on for a run on a
CUDA GPU and off on the CPU; :func:`resolve_switch` is the one place that decides it, through
:meth:`UNetSpec.for_device`, for the device a model is built for (the Lightning system for its run, the sampler for
its device, the preflight for the GPU it predicts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from monai.networks.nets import DiffusionModelUNet

from voxdiff.encodings.base import Encoding
from voxdiff.errors import ConfigError
from voxdiff.models.checkpointing import GRANULARITIES, apply_gradient_checkpointing

MODES = ("bravo", "seg")
AUTO = "auto"  # a run-time switch (model.use_flash_attention, model.compile) that the device decides


def check_switch(key: str, value: Any) -> bool | str:
    """``value`` of a run-time switch (``model.use_flash_attention``, ``model.compile``) if it is true, false or
    ``auto``.

    Raises:
        ConfigError: naming the key, the value and the fix.
    """
    if isinstance(value, bool) or value == AUTO:
        return value
    raise ConfigError(key, value, "must be true, false or auto", f"use {key}=auto (on for a CUDA run, off on the CPU)")


def resolve_switch(key: str, value: bool | str, device_type: str) -> bool:
    """A run-time switch of the model config for a run on ``device_type``: ``auto`` is on for ``cuda`` and off
    elsewhere; ``true``/``false`` as given. The only place ``auto`` is decided."""
    value = check_switch(key, value)
    return value if isinstance(value, bool) else device_type == "cuda"


def compile_modes() -> tuple[str, ...]:
    """The modes ``torch.compile`` takes with inductor (``default``, ``reduce-overhead``, ``max-autotune``, ...)."""
    import torch._inductor  # 2 s: imported only to check a mode that is set

    return tuple(torch._inductor.list_mode_options())


def compile_backends() -> tuple[str, ...]:
    """The backends ``torch.compile`` takes (``inductor``, and debugging ones such as ``aot_eager``)."""
    import torch._dynamo

    return tuple(torch._dynamo.list_backends(exclude_tags=()))


def _plain(value: Any) -> Any:
    """OmegaConf containers → plain Python (Hydra's ListConfig must not reach torch)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return value


def _per_level(key: str, value: Any, levels: int, kind: type, example: str) -> list:
    value = _plain(value)
    if isinstance(value, (list, tuple)):
        if len(value) != levels:
            raise ConfigError(
                f"model.{key}", value,
                f"has {len(value)} entries but model.channels has {levels} levels",
                f"give one entry per level ({levels}), e.g. {example}",
            )
        items = list(value)
    else:
        items = [value] * levels
    for item in items:
        ok = isinstance(item, bool) if kind is bool else isinstance(item, int) and not isinstance(item, bool)
        if not ok or (kind is int and item < 1):
            want = "true or false" if kind is bool else "a positive integer"
            raise ConfigError(f"model.{key}", value, f"each entry must be {want}", f"e.g. {example}")
    return items


@dataclass(frozen=True)
class UNetSpec:
    """The validated arguments of one ``DiffusionModelUNet(spatial_dims=3, ...)``."""

    in_channels: int
    out_channels: int
    channels: tuple[int, ...]
    attention_levels: tuple[bool, ...]
    num_res_blocks: tuple[int, ...]
    num_head_channels: tuple[int, ...]
    norm_num_groups: int
    use_flash_attention: bool | str = False  # true, false or auto (resolved by for_device)
    gradient_checkpointing: str = "none"
    compile: bool | str = False  # torch.compile the training forward: true, false or auto
    compile_mode: str | None = None  # torch.compile(mode=...); None: torch's default mode
    compile_backend: str = "inductor"  # torch.compile(backend=...); aot_eager tells a dynamo/autograd failure apart

    def for_device(self, device_type: str) -> UNetSpec:
        """This spec for a model that runs on ``device_type`` (``cuda``, ``cpu``): ``auto`` switches resolved by
        :func:`resolve_switch`."""
        return replace(self, use_flash_attention=resolve_switch("model.use_flash_attention", self.use_flash_attention,
                                                                device_type),
                       compile=resolve_switch("model.compile", self.compile, device_type))

    @property
    def resolved(self) -> bool:
        """Whether no switch is left at ``auto``."""
        return isinstance(self.use_flash_attention, bool) and isinstance(self.compile, bool)

    @property
    def levels(self) -> int:
        return len(self.channels)

    @property
    def downsampling(self) -> int:
        """Total spatial down-sampling of the UNet: every encoded size must divide by it."""
        return 2 ** (self.levels - 1)

    def monai_kwargs(self) -> dict[str, Any]:
        return dict(
            spatial_dims=3,
            in_channels=self.in_channels,
            out_channels=self.out_channels,
            channels=self.channels,
            attention_levels=self.attention_levels,
            num_res_blocks=self.num_res_blocks,
            num_head_channels=self.num_head_channels,
            norm_num_groups=self.norm_num_groups,
            use_flash_attention=self.use_flash_attention,
        )


def unet_spec(
    in_channels: int,
    out_channels: int,
    channels: Sequence[int],
    attention_levels: Sequence[bool],
    num_res_blocks: int | Sequence[int] = 2,
    num_head_channels: int | Sequence[int] = 32,
    norm_num_groups: int = 32,
    use_flash_attention: bool | str = False,
    gradient_checkpointing: str = "none",
    compile: bool | str = False,
    compile_mode: str | None = None,
    compile_backend: str = "inductor",
) -> UNetSpec:
    """Validate the model config; every failure names the key, the value and a fix.

    Raises:
        ConfigError: on the first argument that cannot work.
    """
    channels = _plain(channels)
    if not isinstance(channels, (list, tuple)) or len(channels) < 2:
        raise ConfigError("model.channels", channels, "a UNet needs at least two levels",
                          "give one channel count per level, e.g. [64, 128, 256, 512]")
    for c in channels:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ConfigError("model.channels", channels, "each level's channel count must be a positive integer",
                              "e.g. [64, 128, 256, 512]")
    levels = len(channels)
    example_bool = "[" + ", ".join(["false"] * (levels - 1) + ["true"]) + "]"
    attention = _per_level("attention_levels", attention_levels, levels, bool, example_bool)
    res_blocks = _per_level("num_res_blocks", num_res_blocks, levels, int, f"{[2] * levels}")
    heads = _per_level("num_head_channels", num_head_channels, levels, int, "32")
    if isinstance(norm_num_groups, bool) or not isinstance(norm_num_groups, int) or norm_num_groups < 1:
        raise ConfigError("model.norm_num_groups", norm_num_groups, "must be a positive integer", "use 32")
    for c in channels:
        if c % norm_num_groups:
            divisors = [g for g in (32, 16, 8, 4, 2, 1) if all(ch % g == 0 for ch in channels)]
            raise ConfigError(
                "model.norm_num_groups", norm_num_groups,
                f"GroupNorm needs every level's channels divisible by it, and {c} (in model.channels={channels}) "
                "is not",
                f"use model.norm_num_groups={divisors[0]}, or channel counts that are multiples of {norm_num_groups}",
            )
    for level, (c, att, h) in enumerate(zip(channels, attention, heads)):
        if level == levels - 1 and c % h:  # MONAI's middle block has attention at the coarsest width, always
            raise ConfigError(
                "model.num_head_channels", _plain(num_head_channels),
                f"the middle block always has attention over the last level's {c} channels, in heads of {h}, "
                "which does not divide",
                f"use a head size that divides {c} (e.g. {next(d for d in (64, 32, 16, 8, 4, 2, 1) if c % d == 0)})",
            )
        if att and c % h:
            raise ConfigError(
                "model.num_head_channels", _plain(num_head_channels),
                f"attention at level {level} splits its {c} channels into heads of {h}, which does not divide",
                f"use a head size that divides {c} (e.g. {next(d for d in (64, 32, 16, 8, 4, 2, 1) if c % d == 0)}),"
                f" or set model.attention_levels[{level}]=false",
            )
    for key, value in (("in_channels", in_channels), ("out_channels", out_channels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.{key}", value, "must be a positive integer",
                              "leave it unset: it follows from the encoding and the mode")
    check_switch("model.use_flash_attention", use_flash_attention)
    check_switch("model.compile", compile)
    if compile_backend != "inductor" and compile_backend not in compile_backends():
        raise ConfigError("model.compile_backend", compile_backend, "is not a torch.compile backend",
                          f"use inductor (the default), or one of {', '.join(compile_backends())}")
    if compile_mode is not None:
        if compile_backend != "inductor":
            raise ConfigError("model.compile_mode", compile_mode, f"is an inductor mode, and model.compile_backend is "
                              f"{compile_backend}", "set model.compile_mode=null, or model.compile_backend=inductor")
        if compile_mode not in compile_modes():
            raise ConfigError("model.compile_mode", compile_mode, "is not a torch.compile mode",
                              f"use null (torch's default) or one of {', '.join(compile_modes())}")
    if gradient_checkpointing not in GRANULARITIES:
        raise ConfigError("model.gradient_checkpointing", gradient_checkpointing, "unknown granularity",
                          f"use one of {', '.join(GRANULARITIES)}")
    return UNetSpec(
        in_channels=in_channels,
        out_channels=out_channels,
        channels=tuple(channels),
        attention_levels=tuple(attention),
        num_res_blocks=tuple(res_blocks),
        num_head_channels=tuple(heads),
        norm_num_groups=norm_num_groups,
        use_flash_attention=use_flash_attention,
        gradient_checkpointing=gradient_checkpointing,
        compile=compile,
        compile_mode=compile_mode,
        compile_backend=compile_backend,
    )


def build_unet(
    in_channels: int,
    out_channels: int,
    channels: Sequence[int],
    attention_levels: Sequence[bool],
    num_res_blocks: int | Sequence[int] = 2,
    num_head_channels: int | Sequence[int] = 32,
    norm_num_groups: int = 32,
    use_flash_attention: bool | str = False,
    gradient_checkpointing: str = "none",
    preserve_rng_state: bool = True,
    device_type: str | None = None,
    compile: bool | str = False,
    compile_mode: str | None = None,
    compile_backend: str = "inductor",
) -> DiffusionModelUNet:
    """Build ``DiffusionModelUNet(spatial_dims=3, ...)`` and apply the gradient-checkpointing policy.

    The model maps ``x (B, in_channels, d, h, w)`` and ``timesteps (B,)`` to ``(B, out_channels, d, h, w)``;
    ``d, h, w`` must each divide by ``2 ** (len(channels) - 1)``. Build it under ``torch.device("meta")`` to
    count parameters at no cost.

    Args:
        in_channels / out_channels: follow from the encoding and the mode (:func:`unet_io_channels`).
        channels: output channels per level, finest first.
        attention_levels: self-attention at each level (true/false per level).
        num_res_blocks: resnet blocks per level (an int for all levels, or one per level).
        num_head_channels: channels per attention head (an int, or one per level).
        norm_num_groups: GroupNorm groups; divides every level's channels.
        use_flash_attention: use ``F.scaled_dot_product_attention`` (memory-efficient / flash on GPUs) instead
            of MONAI's materialised attention; ``auto``: on for ``device_type`` cuda.
        gradient_checkpointing: ``none``, ``block`` or ``layer`` (see :mod:`voxdiff.models.checkpointing`).
        preserve_rng_state: passed to ``torch.utils.checkpoint``.
        device_type: the device the model will run on, which resolves ``auto`` (:meth:`UNetSpec.for_device`).
        compile, compile_mode, compile_backend: validated here; the training step compiles its forward
            (:class:`voxdiff.step.TrainStep`), the model itself is never compiled.
    """
    spec = unet_spec(in_channels, out_channels, channels, attention_levels, num_res_blocks, num_head_channels,
                     norm_num_groups, use_flash_attention, gradient_checkpointing, compile, compile_mode,
                     compile_backend)
    return build_unet_from_spec(spec, preserve_rng_state=preserve_rng_state, device_type=device_type)


def build_unet_from_spec(spec: UNetSpec, preserve_rng_state: bool = True,
                         device_type: str | None = None) -> DiffusionModelUNet:
    """Build the UNet of a validated :class:`UNetSpec` (see :func:`build_unet`), for ``device_type`` when the spec
    has ``auto`` switches (else as resolved already).

    Raises:
        ValueError: an ``auto`` switch and no ``device_type`` to resolve it for.
    """
    if device_type is not None:
        spec = spec.for_device(device_type)
    if not isinstance(spec.use_flash_attention, bool):
        raise ValueError("build_unet_from_spec: model.use_flash_attention=auto needs the device the model runs on "
                         "(device_type=..., or spec.for_device(...))")
    model = DiffusionModelUNet(**spec.monai_kwargs())
    apply_gradient_checkpointing(model, spec.gradient_checkpointing, preserve_rng_state=preserve_rng_state)
    return model


def unet_io_channels(encoding: Encoding, mode: str, image_channels: int = 1, mask_channels: int = 1) -> tuple[int, int]:
    """UNet (in, out) channels for an encoding and a generation mode.

    * ``bravo``: the image encoding and the mask encoding concatenated in, the image encoding out
      (S2D f=2: 16 in / 8 out; 4-channel latents: 8 in / 4 out).
    * ``seg``: the mask encoding in and out.
    """
    if mode == "bravo":
        return (encoding.encoded_channels(image_channels) + encoding.encoded_channels(mask_channels),
                encoding.encoded_channels(image_channels))
    if mode == "seg":
        return encoding.encoded_channels(mask_channels), encoding.encoded_channels(mask_channels)
    raise ConfigError("mode", mode, "unknown generation mode",
                      "use mode=bravo (image conditioned on the mask) or mode=seg (masks alone)")


def count_parameters(model) -> int:
    """Number of parameters (works on meta-device models)."""
    return sum(p.numel() for p in model.parameters())
