"""What a checkpoint is: the kind of run that wrote it (:func:`checkpoint_kind`) and where it keeps its run's
resolved config (:data:`CONFIG_KEY`).

A checkpoint is read as data (:func:`voxdiff.files.load_file`), and the config stored in it is never handed to
Hydra's ``instantiate`` as it is: runs are rebuilt from its plain values through voxdiff's own builders
(:func:`voxdiff.lightning.systems.rebuild_system`; :func:`voxdiff.config.instantiate_voxdiff` accepts only voxdiff's
own classes). Nor does a path stored in it decide what a command reads or writes: :func:`stored_weights_path` finds
the stage-1 weights file a latent run names, which :func:`without_weights_path` takes out of what the system is
rebuilt from (``sample.py`` and ``evaluate.py`` read the weights their user names, :mod:`voxdiff.cli.checkpoint_paths`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from voxdiff.config import RUN_KINDS
from voxdiff.errors import ConfigError

#: where a training checkpoint keeps its run's resolved config, as plain data (the run spec's stored form,
#: :func:`voxdiff.run.spec.stored_run_spec`; written by :class:`voxdiff.lightning.callbacks.ConfigInCheckpoint`)
CONFIG_KEY = "voxdiff_config"

#: a run's guide snapshot for autoguidance, ``checkpoints/guide-step<N>.ckpt`` (written by
#: :class:`voxdiff.lightning.callbacks.GuideSnapshot`, found by ``sample.py`` / ``evaluate.py`` beside ``ckpt_path``)
GUIDE_GLOB = "guide-step*.ckpt"


def guide_checkpoint_name(step: int) -> str:
    """The file name of a run's guide snapshot taken after optimizer step ``step`` (matches :data:`GUIDE_GLOB`)."""
    return f"guide-step{step:07d}.ckpt"


#: what kind of checkpoint a file is, keyed as :func:`checkpoint_kind` returns it: the kind of run that wrote it
#: (:data:`voxdiff.config.RUN_KINDS`), or ``unknown``
KINDS = {
    "diffusion": "a diffusion-UNet checkpoint (DiffusionSystem, system=diffusion)",
    "stage1": "a VQ-VAE stage-1 checkpoint (VQVAESystem, system=vqvae)",
    "unknown": "not a checkpoint of voxdiff's train.py (no DiffusionSystem or VQVAESystem hyper-parameters in it)",
}


def checkpoint_kind(checkpoint: Mapping[str, Any]) -> str:
    """Which kind of run wrote a loaded checkpoint: ``"diffusion"`` or ``"stage1"`` (:data:`KINDS`,
    :data:`voxdiff.config.RUN_KINDS`), or ``"unknown"``.

    A voxdiff system records its kind in the checkpoint (``hyper_parameters.kind``, its class's ``kind``); a recorded
    kind that is not a run kind is ``unknown``. Compatibility: a checkpoint written before the kind was recorded (no
    ``kind`` among its hyper-parameters) is recognised by its structure — the diffusion system's ``model``,
    ``encoding``, ``diffusion`` and ``mode``, or the stage 1's ``vqvae``.
    """
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    if not isinstance(hparams, Mapping):
        return "unknown"
    if "kind" in hparams:
        return hparams["kind"] if hparams["kind"] in RUN_KINDS else "unknown"
    if {"model", "encoding", "diffusion", "mode"} <= set(hparams):
        return "diffusion"
    if "vqvae" in hparams:
        return "stage1"
    return "unknown"


def non_finite_tensor(checkpoint: Mapping[str, Any]) -> str | None:
    """The name of the first weight of a checkpoint that holds a NaN or an infinity — in its ``state_dict``, then
    in its EMA weights (``ema.shadow``) — or None when every one is finite. Sampling, evaluating or resuming from
    such weights would only spread them; the guard never writes them, so a file that has them was damaged or
    written by something else."""
    import torch  # deferred: reading a checkpoint's kind needs no torch

    parts = (("state_dict", checkpoint.get("state_dict")),
             ("ema.shadow", (checkpoint.get("ema") or {}).get("shadow") if isinstance(checkpoint.get("ema"), Mapping)
              else None))
    for where, tensors in parts:
        for name, t in (tensors or {}).items():
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"{where}.{name}"
    return None


def stored_weights_path(checkpoint: Mapping[str, Any]) -> str | None:
    """The weights file of the learned encoding a diffusion checkpoint names (a latent run's stage-1 checkpoint:
    its stored config's ``encoding.checkpoint``, else its hyper-parameters'), or None. A path on the machine that
    trained it: a command reads it only where its user confirms it (:mod:`voxdiff.cli.checkpoint_paths`)."""
    for node in ((checkpoint.get(CONFIG_KEY) or {}).get("encoding"),
                 (checkpoint.get("hyper_parameters") or {}).get("encoding")):
        if isinstance(node, Mapping) and node.get("checkpoint") not in (None, ""):
            return str(node["checkpoint"])
    return None


def without_weights_path(node: Any) -> Any:
    """A copy of a stored ``encoding`` node (or of a config holding one as ``encoding`` or ``system.encoding``) with
    the weights file it names (``checkpoint``) set to None; anything else is returned as it is."""
    if not isinstance(node, Mapping):
        return node
    out = dict(node)
    if "checkpoint" in out and "_target_" in out:  # an encoding node
        out["checkpoint"] = None
    for key in ("encoding", "system"):
        if isinstance(out.get(key), Mapping):
            out[key] = without_weights_path(out[key])
    return out


def weights_differences(expected: Mapping[str, Any], checkpoint: Mapping[str, Any], limit: int = 4) -> str | None:
    """What keeps a checkpoint's weights from loading into a model whose ``state_dict()`` is ``expected``, in one
    line (the first ``limit`` of each kind, and how many there are), or None when every tensor of its
    ``state_dict`` and of its EMA weights (``ema.shadow``, named as the model's ``model.`` parameters) has the
    model's name and shape. Where ``torch``'s ``load_state_dict`` prints pages, this names the keys."""
    found = checkpoint.get("state_dict") or {}
    shape = lambda t: tuple(t.shape) if hasattr(t, "shape") else None  # noqa: E731
    problems: list[str] = []

    def note(what: str, names: list[str]) -> None:
        if names:
            more = f" and {len(names) - limit} more" if len(names) > limit else ""
            problems.append(f"{len(names)} {what}: {', '.join(names[:limit])}{more}")

    note("weights of the model are not in the checkpoint", [k for k in expected if k not in found])
    note("weights of the checkpoint are not in the model", [k for k in found if k not in expected])
    note("weights have other shapes (checkpoint vs model)",
         [f"{k} {list(shape(found[k]) or [])} vs {list(shape(v) or [])}" for k, v in expected.items()
          if k in found and shape(found[k]) != shape(v)])
    ema = checkpoint.get("ema")
    shadow = ema.get("shadow") if isinstance(ema, Mapping) else None
    if isinstance(shadow, Mapping):
        note("EMA weights have other shapes (checkpoint vs model)",
             [f"ema.shadow.{k} {list(shape(t) or [])} vs {list(shape(expected[f'model.{k}']) or [])}"
              for k, t in shadow.items() if f"model.{k}" in expected and shape(t) != shape(expected[f"model.{k}"])])
    return "; ".join(problems) or None
