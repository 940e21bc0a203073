"""The UNet's rules of a configuration, before any tracing or building: each failure names key, value and a fix.

:func:`voxdiff.run.spec.run_spec_problems` runs them with the rest of a config's checks, every failure reported:

1. the volume divides by the encoding's factor (``data.volume_shape`` vs ``encoding``: the encoding's own check,
   through :func:`voxdiff.config.shapes`);
2. every encoded spatial size divides by ``2 ** (levels - 1)`` for the UNet's levels (:func:`check_unet_divisibility`,
   with the deepest UNet that fits and the padded or cropped volume as fixes);
3. the UNet arguments are consistent (list lengths = levels, channels divisible by ``norm_num_groups``, channels at
   attention levels divisible by ``num_head_channels``, ...) — :func:`voxdiff.models.unet_spec`;
4. UNet in/out channels, when a config sets them, agree with the encoding and the mode (:func:`check_io_channels`);
5. a compile mode with CUDA graphs, asked for by name, on a run that cannot replay them (:func:`check_cuda_graphs`);
6. channels-last weights under FSDP, which flattens them (:func:`check_channels_last`).
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from voxdiff.config import accumulated_batches, plain, strategy_kind, volume_shape
from voxdiff.encodings import Encoding
from voxdiff.encodings.base import AXES
from voxdiff.errors import ConfigError
from voxdiff.models import unet_io_channels
from voxdiff.models.unet import CUDAGRAPH_MODES, unet_downsampling


def _levels(cfg: DictConfig) -> int:
    channels = plain(cfg.model.get("channels"))
    return len(channels) if isinstance(channels, (list, tuple)) else 0


def check_unet_divisibility(cfg: DictConfig, encoding: Encoding) -> None:
    levels = _levels(cfg)
    if levels < 2:
        return  # reported by check_model_arguments
    vol = volume_shape(cfg)
    need = unet_downsampling(levels)
    encoded = [s // encoding.factor for s in vol]
    for axis, size in zip(AXES, encoded):
        if size % need:
            # the deepest UNet every axis allows, and the volume padded so that this depth works
            fits = [lv for lv in range(2, levels) if all(e % unet_downsampling(lv) == 0 for e in encoded)]
            step = encoding.factor * need
            padded = [math.ceil(s / step) * step for s in vol]
            cropped = [s // step * step for s in vol]
            i = AXES.index(axis)
            options = []
            if fits:
                options.append(f"use {fits[-1]} levels (model.channels with {fits[-1]} entries)")
            options.append(f"pad the volume to {padded[i]} (data.volume_shape={padded})")
            if all(cropped) and cropped[i] != padded[i]:
                options.append(f"crop it to {cropped[i]} (data.volume_shape={cropped})")
            shape = "×".join(map(str, encoded))
            raise ConfigError(
                "data.volume_shape", list(vol),
                f"{axis} {size} of {encoding.label} ({shape}) is not divisible by {need}, which a {levels}-level "
                f"UNet needs",
                ", or ".join(options),
            )


def check_io_channels(cfg: DictConfig, encoding: Encoding) -> None:
    expected = dict(zip(("in_channels", "out_channels"), unet_io_channels(encoding, cfg.mode)))
    for key, want in expected.items():
        got = cfg.model.get(key)
        if got is not None and got != want:
            what = ("the image and mask encodings" if cfg.mode == "bravo" and key == "in_channels"
                    else "the image encoding" if cfg.mode == "bravo" else "the mask encoding")
            raise ConfigError(
                f"model.{key}", got,
                f"mode={cfg.mode} with {encoding.label} has {want} channels ({what})",
                f"remove model.{key} (it follows from the encoding and the mode) or set it to {want}",
            )


def check_cuda_graphs(cfg: DictConfig, device_type: str) -> None:
    """Refuse ``model.compile_mode`` set to a mode with CUDA graphs (``reduce-overhead``, ``max-autotune``) on a
    compiled CUDA run that cannot replay them: gradient accumulation (the next micro-batch's replay overwrites the
    gradients the previous one left in ``.grad``: torch raises when they are read) or FSDP (the graphs replay fixed
    addresses; FSDP gathers the parameters into new memory at every step). ``auto`` never takes them there
    (:func:`voxdiff.config.cuda_graphs_fit`)."""
    model = cfg.get("model") or {}
    mode, compiled = model.get("compile_mode"), model.get("compile", "auto")
    if device_type != "cuda" or mode not in CUDAGRAPH_MODES or compiled is False:
        return
    trainer = cfg.get("trainer") or {}
    accumulate = accumulated_batches(trainer)
    if accumulate != 1:
        raise ConfigError("model.compile_mode", mode, f"captures CUDA graphs, and trainer.accumulate_grad_batches="
                          f"{accumulate} keeps gradients in .grad between micro-batches, which the next replay "
                          "overwrites (torch raises when they are read)",
                          "use model.compile_mode=auto (torch's default mode for this run), or "
                          "trainer.accumulate_grad_batches=1")
    if strategy_kind(plain(trainer.get("strategy"))) == "fsdp":
        raise ConfigError("model.compile_mode", mode, "captures CUDA graphs, which replay fixed memory addresses, "
                          "and FSDP gathers the parameters into new memory at every step",
                          "use model.compile_mode=auto (torch's default mode under FSDP)")


def check_channels_last(cfg: DictConfig) -> None:
    """Refuse ``model.channels_last=true`` under FSDP: it flattens each wrapped module's weights into one contiguous
    buffer and hands the convolutions views of it, so no weight can be channels-last there."""
    model = cfg.get("model") or {}
    if model.get("channels_last") is not True:
        return
    trainer = cfg.get("trainer") or {}
    if strategy_kind(plain(trainer.get("strategy"))) == "fsdp":
        raise ConfigError("model.channels_last", True, "keeps the convolution weights channels-last, and FSDP "
                          "flattens the weights into one contiguous buffer",
                          "use model.channels_last=false under FSDP, or trainer.strategy=ddp")
