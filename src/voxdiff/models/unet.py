"""Build MONAI's 3D ``DiffusionModelUNet`` from a plain config, validated up front.

Two switches of the config decide how the model runs rather than what it computes, and both take ``auto``:
``use_flash_attention`` (SDPA instead of MONAI's materialised attention scores) and ``compile``
(``torch.compile`` of the training forward, :class:`voxdiff.step.TrainStep`). ``auto`` means on for a run on a
CUDA GPU and off on the CPU; :func:`resolve_switch` is the one place that decides it, through
:meth:`UNetSpec.for_device`, for the device a model is built for (the Lightning system for its run, the sampler for
its device, the preflight for the GPU it predicts).

``compile_mode`` takes ``auto`` too (:func:`resolve_compile_mode`): CUDA graphs (``reduce-overhead``) for a compiled
run on one CUDA GPU without gradient accumulation, torch's default mode elsewhere. Measured on one H100
(``reference/README.md``, session 11): exp11's step 104 ms in the default mode, 31 ms with CUDA graphs (the default
mode's step was launch-bound: its kernels kept the GPU busy 29 ms of the 104); exp9_ldm_4x_bravo's 203 and 201 ms
(compute-bound).

``channels_last`` keeps the UNet's 5-D weights and its input in ``torch.channels_last_3d``
(:func:`apply_channels_last`), and makes inductor lay out the compiled graph's tensors the same way
(:class:`voxdiff.step.CompileSettings`). Why: cuDNN runs its bf16 3D convolutions in NDHWC, and converts NCDHW
tensors to it and back around each one (exp9_ldm_8x_bravo on an H100: 20.3 of its 127.9 ms of kernels); inductor
does not choose channels-last by itself for a UNet (its heuristic skips graphs with a convolution of fewer output
than input channels, as a UNet's decoder has). ``auto`` (:func:`resolve_channels_last`) is on for a compiled CUDA run
whose weights are not flattened (FSDP), off elsewhere: every compiled GPU step measured channels-last was faster
(``reference/README.md``: exp11 at batch 1 0.96x its time on an H100; exp9_ldm_8x_bravo's hand-tuned loop 0.872x
and voxdiff's step 0.938x that NCDHW loop on an H200); an eager GPU step is unmeasured, and on a CPU it was slower
(the demo: 1.14 steps/s against 1.35, ``docs/demo_recipe.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from monai.networks.nets import DiffusionModelUNet
from torch import nn

from voxdiff.encodings.base import Encoding
from voxdiff.errors import ConfigError, int_list, integer, plain
from voxdiff.models.checkpointing import GRANULARITIES, apply_gradient_checkpointing
from voxdiff.models.covariates import attach_covariates

MODES = ("bravo", "seg")
AUTO = "auto"  # a run-time switch (model.use_flash_attention, model.compile, model.channels_last) the run decides
#: ``torch.compile`` modes that capture CUDA graphs (inductor's ``triton.cudagraphs``)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_switch(key: str, value: Any, auto: str = "on for a CUDA run, off on the CPU") -> bool | str:
    """``value`` of a run-time switch (``model.use_flash_attention``, ``model.compile``, ``model.channels_last``) if
    it is true, false or ``auto`` (``auto``: what it means for this key, for the fix).

    Raises:
        ConfigError: naming the key, the value and the fix.
    """
    if isinstance(value, bool) or value == AUTO:
        return value
    raise ConfigError(key, value, "must be true, false or auto", f"use {key}=auto ({auto})")


#: what ``model.channels_last=auto`` means (:func:`resolve_channels_last`)
CHANNELS_LAST_AUTO = "on for a compiled CUDA run, not under FSDP; off elsewhere"


def resolve_switch(key: str, value: bool | str, device_type: str) -> bool:
    """A run-time switch of the model config for a run on ``device_type``: ``auto`` is on for ``cuda`` and off
    elsewhere; ``true``/``false`` as given. The only place ``auto`` is decided."""
    value = check_switch(key, value)
    return value if isinstance(value, bool) else device_type == "cuda"


def resolve_channels_last(value: bool | str, device_type: str, compiled: bool, flat_weights: bool) -> bool:
    """``model.channels_last`` for a run on ``device_type``: ``auto`` is on for a ``compiled`` (inductor) ``cuda``
    run whose weights are not flattened into one buffer (``flat_weights``: FSDP, which refuses ``true``), off
    elsewhere; ``true``/``false`` as given. The only place ``auto`` is decided."""
    value = check_switch("model.channels_last", value, CHANNELS_LAST_AUTO)
    return value if isinstance(value, bool) else device_type == "cuda" and compiled and not flat_weights


def resolve_compile_mode(mode: str | None, device_type: str, cuda_graphs: bool) -> str | None:
    """``model.compile_mode`` for a run on ``device_type``: ``auto`` is ``reduce-overhead`` (CUDA graphs) on ``cuda``
    when ``cuda_graphs`` (the run can replay them: one process, no gradient accumulation, inductor), else None
    (torch's default mode); any other value as given. The only place ``auto`` is decided."""
    if mode != AUTO:
        return mode
    return "reduce-overhead" if device_type == "cuda" and cuda_graphs else None


def compile_modes() -> tuple[str, ...]:
    """The modes ``torch.compile`` takes with inductor (``default``, ``reduce-overhead``, ``max-autotune``, ...)."""
    import torch._inductor  # 2 s: imported only to check a mode that is set

    return tuple(torch._inductor.list_mode_options())


def compile_backends() -> tuple[str, ...]:
    """The backends ``torch.compile`` takes (``inductor``, and debugging ones such as ``aot_eager``)."""
    import torch._dynamo

    return tuple(torch._dynamo.list_backends(exclude_tags=()))


def unet_downsampling(levels: int) -> int:
    """Total spatial down-sampling of a UNet of ``levels`` levels: every input size must divide by it, or the skip
    connections do not match (:meth:`UNetSpec.check_input`, the rules of :mod:`voxdiff.run.spec`)."""
    return 2 ** (levels - 1)


def row_ints(text: Any) -> tuple[int, ...]:
    """``"32 64 128"`` (or comma-separated) of a CSV cell → ``(32, 64, 128)``."""
    return tuple(int(v) for v in str(text).replace(",", " ").split())


def row_flag(text: Any, default: bool = False) -> bool:
    """A 0/1 (true/false, yes/no) CSV cell; empty or ``none``: ``default``."""
    s = str(text).strip().lower()
    if s in ("", "none"):
        return default
    if s in ("1", "true", "yes", "t", "y"):
        return True
    if s in ("0", "false", "no", "f", "n"):
        return False
    raise ValueError(f"cannot read {text!r} as a 0/1 flag")


ROW_COLUMNS: tuple[str, ...] = ("in_channels", "out_channels", "channels", "attention_levels", "num_res_blocks",
                                "num_head_channels", "norm_num_groups", "grad_checkpointing", "use_flash_attention")
"""The columns of a UNet in a CSV row (:meth:`UNetSpec.from_row`, :meth:`UNetSpec.to_row`), as in
``reference/h100_measured.csv``; ``grad_checkpointing`` and ``use_flash_attention`` may be absent (0)."""

_CHECKPOINTING_CELLS = {"none": "0", "layer": "1"}  # the reference CSVs' 0/1; "block" is written by name


def _per_level(key: str, value: Any, levels: int, kind: type, example: str) -> list:
    value = plain(value)
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
    compile_mode: str | None = None  # torch.compile(mode=...); None: torch's default mode; auto: by the run
    compile_backend: str = "inductor"  # torch.compile(backend=...); aot_eager tells a dynamo/autograd failure apart
    covariate_dim: int = 0  # K of the covariate vector (voxdiff.models.covariates); 0: no covariates
    channels_last: bool | str = False  # 5-D weights and input in torch.channels_last_3d: true, false or auto

    def for_device(self, device_type: str, cuda_graphs: bool = True, flat_weights: bool = False) -> UNetSpec:
        """This spec for a model that runs on ``device_type`` (``cuda``, ``cpu``): ``auto`` switches resolved by
        :func:`resolve_switch`, an ``auto`` compile mode by :func:`resolve_compile_mode` (``cuda_graphs``: whether
        the run could replay CUDA graphs, :func:`voxdiff.config.cuda_graphs_fit`), an ``auto`` layout by
        :func:`resolve_channels_last` (``flat_weights``: FSDP)."""
        compiled = resolve_switch("model.compile", self.compile, device_type)
        return replace(self, use_flash_attention=resolve_switch("model.use_flash_attention", self.use_flash_attention,
                                                                device_type),
                       compile=compiled,
                       compile_mode=resolve_compile_mode(self.compile_mode, device_type,
                                                         cuda_graphs and self.compile_backend == "inductor"),
                       channels_last=resolve_channels_last(self.channels_last, device_type,
                                                           compiled and self.compile_backend == "inductor",
                                                           flat_weights))

    @property
    def resolved(self) -> bool:
        """Whether no switch is left at ``auto``."""
        return (isinstance(self.use_flash_attention, bool) and isinstance(self.compile, bool)
                and self.compile_mode != AUTO and isinstance(self.channels_last, bool))

    @property
    def cuda_graphs(self) -> bool:
        """Whether the training forward is compiled in a mode that captures CUDA graphs (on a CUDA GPU)."""
        return bool(self.compile) and self.compile_mode in CUDAGRAPH_MODES

    @property
    def levels(self) -> int:
        return len(self.channels)

    @property
    def downsampling(self) -> int:
        """Total spatial down-sampling of the UNet: every encoded size must divide by it."""
        return unet_downsampling(self.levels)

    def check_input(self, input_shape: Sequence[int], key: str = "input_shape") -> None:
        """Refuse an input ``(B, C_in, D, H, W)`` that this UNet cannot take: ``C_in`` other than ``in_channels``, or
        a spatial size that does not divide by :attr:`downsampling`.

        Raises:
            ConfigError: naming ``key``, the shape and the fix.
        """
        shape = tuple(input_shape)
        if shape[1] != self.in_channels:
            raise ConfigError(key, list(shape), f"has {shape[1]} channels but in_channels={self.in_channels}",
                              f"give the UNet input's channels ({self.in_channels}) or in_channels={shape[1]}")
        odd = [s for s in shape[2:] if s % self.downsampling]
        if odd:
            raise ConfigError(key, list(shape), f"spatial size {shape[2:]} is not divisible by 2**(levels-1)="
                              f"{self.downsampling} (the skip connections would not match)",
                              f"use sizes that are multiples of {self.downsampling}, or fewer levels")

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> UNetSpec:
        """The spec of one CSV row in the format of ``reference/h100_measured.csv`` (:data:`ROW_COLUMNS`; every other
        column is ignored): numbers per level space-separated, ``attention_levels`` as 0/1 per level,
        ``num_head_channels`` one per level or one for all, ``grad_checkpointing`` 0/1 (``layer``) or a granularity
        name, ``use_flash_attention`` 0/1. Validated by :func:`unet_spec`.

        Raises:
            ValueError: a cell that is not a number or a flag; ConfigError: arguments that cannot work; KeyError: a
                required column missing.
        """
        heads = row_ints(row["num_head_channels"])
        checkpointing = str(row.get("grad_checkpointing") or "0").strip().lower()
        return unet_spec(
            in_channels=int(row["in_channels"]),
            out_channels=int(row["out_channels"]),
            channels=list(row_ints(row["channels"])),
            attention_levels=[bool(v) for v in row_ints(row["attention_levels"])],
            num_res_blocks=list(row_ints(row["num_res_blocks"])),
            num_head_channels=heads[0] if len(heads) == 1 else list(heads),
            norm_num_groups=int(row["norm_num_groups"]),
            use_flash_attention=row_flag(row.get("use_flash_attention", "")),
            gradient_checkpointing=checkpointing if checkpointing in GRANULARITIES
            else "layer" if row_flag(checkpointing) else "none",
        )

    def to_row(self) -> dict[str, str]:
        """The :data:`ROW_COLUMNS` of this spec as CSV cells; :meth:`from_row` reads them back to an equal spec.

        Raises:
            ValueError: ``use_flash_attention`` still ``auto`` (resolve it with :meth:`for_device` first).
        """
        if not isinstance(self.use_flash_attention, bool):
            raise ValueError("UNetSpec.to_row: use_flash_attention=auto has no row value; resolve it first "
                             "(spec.for_device('cuda'))")
        words = lambda values: " ".join(str(int(v)) for v in values)  # noqa: E731
        return {
            "in_channels": str(self.in_channels),
            "out_channels": str(self.out_channels),
            "channels": words(self.channels),
            "attention_levels": words(self.attention_levels),
            "num_res_blocks": words(self.num_res_blocks),
            "num_head_channels": words(self.num_head_channels),
            "norm_num_groups": str(self.norm_num_groups),
            "grad_checkpointing": _CHECKPOINTING_CELLS.get(self.gradient_checkpointing, self.gradient_checkpointing),
            "use_flash_attention": str(int(self.use_flash_attention)),
        }

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
    channels_last: bool | str = False,
) -> UNetSpec:
    """Validate the model config; every failure names the key, the value and a fix.

    Raises:
        ConfigError: on the first argument that cannot work.
    """
    channels = plain(channels)
    if not isinstance(channels, (list, tuple)) or len(channels) < 2:
        raise ConfigError("model.channels", channels, "a UNet needs at least two levels",
                          "give one channel count per level, e.g. [64, 128, 256, 512]")
    int_list("model.channels", channels, minimum=1, fix="one channel count per level, e.g. [64, 128, 256, 512]")
    levels = len(channels)
    example_bool = "[" + ", ".join(["false"] * (levels - 1) + ["true"]) + "]"
    attention = _per_level("attention_levels", attention_levels, levels, bool, example_bool)
    res_blocks = _per_level("num_res_blocks", num_res_blocks, levels, int, f"{[2] * levels}")
    heads = _per_level("num_head_channels", num_head_channels, levels, int, "32")
    integer("model.norm_num_groups", norm_num_groups, minimum=1, fix="use 32")
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
                "model.num_head_channels", plain(num_head_channels),
                f"the middle block always has attention over the last level's {c} channels, in heads of {h}, "
                "which does not divide",
                f"use a head size that divides {c} (e.g. {next(d for d in (64, 32, 16, 8, 4, 2, 1) if c % d == 0)})",
            )
        if att and c % h:
            raise ConfigError(
                "model.num_head_channels", plain(num_head_channels),
                f"attention at level {level} splits its {c} channels into heads of {h}, which does not divide",
                f"use a head size that divides {c} (e.g. {next(d for d in (64, 32, 16, 8, 4, 2, 1) if c % d == 0)}),"
                f" or set model.attention_levels[{level}]=false",
            )
    for key, value in (("in_channels", in_channels), ("out_channels", out_channels)):
        integer(f"model.{key}", value, minimum=1, fix="leave it unset: it follows from the encoding and the mode")
    check_switch("model.use_flash_attention", use_flash_attention)
    check_switch("model.compile", compile)
    if compile_backend != "inductor" and compile_backend not in compile_backends():
        raise ConfigError("model.compile_backend", compile_backend, "is not a torch.compile backend",
                          f"use inductor (the default), or one of {', '.join(compile_backends())}")
    if compile_mode is not None and compile_mode != AUTO:
        if compile_backend != "inductor":
            raise ConfigError("model.compile_mode", compile_mode, f"is an inductor mode, and model.compile_backend is "
                              f"{compile_backend}", "set model.compile_mode=null, or model.compile_backend=inductor")
        if compile_mode not in compile_modes():
            raise ConfigError("model.compile_mode", compile_mode, "is not a torch.compile mode",
                              f"use auto, null (torch's default) or one of {', '.join(compile_modes())}")
    if gradient_checkpointing not in GRANULARITIES:
        raise ConfigError("model.gradient_checkpointing", gradient_checkpointing, "unknown granularity",
                          f"use one of {', '.join(GRANULARITIES)}")
    check_switch("model.channels_last", channels_last, CHANNELS_LAST_AUTO)
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
        channels_last=channels_last,
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
    channels_last: bool | str = False,
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
        channels_last: weights and input in ``torch.channels_last_3d`` (:func:`apply_channels_last`); ``auto``:
            on for a compiled ``device_type`` cuda run (:func:`resolve_channels_last`).
    """
    spec = unet_spec(in_channels, out_channels, channels, attention_levels, num_res_blocks, num_head_channels,
                     norm_num_groups, use_flash_attention, gradient_checkpointing, compile, compile_mode,
                     compile_backend, channels_last)
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
    if not (isinstance(spec.use_flash_attention, bool) and isinstance(spec.channels_last, bool)):
        raise ValueError("build_unet_from_spec: model.use_flash_attention=auto or model.channels_last=auto needs the "
                         "device the model runs on (device_type=..., or spec.for_device(...))")
    model = DiffusionModelUNet(**spec.monai_kwargs())
    if spec.covariate_dim:
        attach_covariates(model, spec.covariate_dim)
    apply_gradient_checkpointing(model, spec.gradient_checkpointing, preserve_rng_state=preserve_rng_state)
    if spec.channels_last:
        apply_channels_last(model)
    return model


def _input_channels_last(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x = args[0]  # (B, C_in, D, H, W)
    return (x.contiguous(memory_format=torch.channels_last_3d), *args[1:])


def apply_channels_last(model: nn.Module) -> nn.Module:
    """Keep ``model``'s 5-D weights (the convolutions') in ``torch.channels_last_3d``, and convert its input ``x``
    ``(B, C, D, H, W)`` to that layout at every call (a forward pre-hook, so the eager module, its compiled forward,
    validation and sampling all see it). Its outputs follow (``(B, C_out, D, H, W)``, channels-last strides); the
    values are those of the contiguous model up to the order of floating-point sums. Moving the model to another
    device keeps the layout, and so do its gradients, the optimizer's state and the EMA's copies (made from the
    weights); ``state_dict`` keys and shapes do not change, so checkpoints load either way."""
    model.to(memory_format=torch.channels_last_3d)
    model.register_forward_pre_hook(_input_channels_last)
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
