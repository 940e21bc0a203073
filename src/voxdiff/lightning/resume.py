"""Resuming a run: only from a checkpoint this config can continue, and with every changed setting accounted for.

:func:`check_resume` reads the checkpoint's metadata (tensors memory-mapped, never unpickled code) before
anything is built and

* refuses a checkpoint of the other system (a VQ-VAE stage 1 given to a diffusion run, or the reverse), saying
  what it is and what to pass instead;
* refuses *architectural* differences, naming every differing key: what defines the weights and what they
  predict — ``model.*`` (but ``gradient_checkpointing``, ``use_flash_attention`` and ``compile*``, which change
  memory and speed, not weights), ``encoding.*`` (but a learned encoding's weights file, ``checkpoint``),
  ``mode``, ``diffusion.`` ``process``, ``num_train_timesteps``, ``schedule``, ``beta_start``, ``beta_end``,
  ``prediction_type``; the covariates, ``data.covariates`` (the names, in order: the checkpoint's encoding
  against the current list; and, once the data is read, the training split's encoding of them against the
  checkpoint's, :meth:`ResumePlan.check_covariates`); for a stage 1
  ``system.vqvae.*`` but ``use_checkpoint``, ``commitment_cost`` and ``decay``;
* lists every other setting that changed since the checkpoint. They are all applied: most are read from the
  current config when the run is built; the optimizer's (``system.optim.*``, which Lightning would restore from the
  checkpoint with its state) are applied by :class:`FollowCurrentOptimizer`. One is not: ``seed`` (the RNG
  states continue from the checkpoint), and the message says so.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf

from voxdiff.checkpoint import CONFIG_KEY, KINDS, checkpoint_kind, non_finite_tensor, weights_differences
from voxdiff.config import encoding_configs, plain
from voxdiff.data.covariates import CovariateEncoding, parse_covariates
from voxdiff.encodings import LearnedEncoding
from voxdiff.errors import ConfigError, show_value
from voxdiff.files import load_file
from voxdiff.run.spec import RunSpec, run_spec, system_spec

#: UNet arguments that change memory and speed, not the weights
RUNTIME_MODEL_KEYS = ("use_flash_attention", "gradient_checkpointing", "compile", "compile_mode", "compile_backend",
                      "channels_last", "in_channels", "out_channels", "covariate_dim")
#: diffusion settings that define what the UNet predicts (a key the other process does not have compares as absent)
PROCESS_KEYS = ("process", "num_train_timesteps", "schedule", "beta_start", "beta_end", "prediction_type", "sigma_data",
                "data_mean")
#: VQ-VAE settings that do not change its weights' shapes
VQVAE_TRAINING_KEYS = ("use_checkpoint", "commitment_cost", "decay")
#: config keys not compared: where the run lives, and what derives from it
NOT_COMPARED = ("hydra", "hydra.*", "paths.*", "ckpt_path", "overwrite", "trainer.default_root_dir",
                "callbacks.*.dirpath", "logger.save_dir", "logger.*.save_dir", "data.cache_dir")
#: settings that a resume does not apply, and why
NOT_APPLIED = {"seed": "the RNG states continue from the checkpoint"}

#: what a run of each kind (:data:`voxdiff.config.RUN_KINDS`) trains, as the refusal of another kind's checkpoint
#: names it
_RUNS = {"diffusion": "the diffusion UNet (system=diffusion)", "stage1": "the VQ-VAE stage 1 (system=vqvae)"}
_RESUME_FIX = ("point ckpt_path at a checkpoint of this run (<run dir>/checkpoints/last.ckpt or best-step*.ckpt), "
               "or use ckpt_path=auto or null")


@dataclass
class ResumePlan:
    """What a resume continues and what changed since the checkpoint."""

    path: str
    step: int
    applied: list[str] = field(default_factory=list)  # "key: old → new"
    not_applied: list[str] = field(default_factory=list)  # "key: old → new (why)"
    covariates: Mapping[str, Any] | None = None  # the checkpoint's covariate encoding (plain), if it has one

    def check_covariates(self, fitted: CovariateEncoding | None) -> None:
        """Refuse to continue when the data module's encoding of the covariates (fitted on the current training
        split) is not the checkpoint's: the model learned to read the checkpoint's normalisation and levels, and a
        resume on other subjects or another table would feed it other numbers silently.

        Raises:
            ConfigError: ``data.covariates``, naming each column that differs and how.
        """
        if self.covariates is None or fitted is None:  # a changed list is refused by check_resume already
            return
        stored = CovariateEncoding.from_plain(self.covariates)
        if stored == fitted:
            return
        changes = []
        for old, new in zip(stored.columns, fitted.columns, strict=True):
            if old == new:
                continue
            if old.kind == "categorical" and new.kind == "categorical":
                changes.append(f"{old.name}: levels {list(old.levels)} → {list(new.levels)}")
            elif old.kind == new.kind:
                changes.append(f"{old.name}: mean {old.mean:.6g} → {new.mean:.6g}, std {old.std:.6g} → {new.std:.6g}, "
                               f"range [{old.lo:g}, {old.hi:g}] → [{new.lo:g}, {new.hi:g}]")
            else:
                changes.append(f"{old.name}: {old.kind} → {new.kind}")
        raise ConfigError("data.covariates", list(stored.names),
                          f"the training split's encoding of them is not the one {self.path} was trained with ("
                          + "; ".join(changes) + "): the subjects or the participants table changed since",
                          "resume with the subjects and table it trained on, or train on the new data as a new run "
                          "(ckpt_path=null, another paths.run_dir)")

    def summary(self) -> str:
        lines = [f"resuming from {self.path} (step {self.step})"]
        if self.applied:
            lines.append("changed since the checkpoint, applied: " + "; ".join(self.applied))
        if self.not_applied:
            lines.append("changed since the checkpoint, NOT applied: " + "; ".join(self.not_applied))
        return "\n".join(lines)


def _cli(value: Any) -> str:
    """A value as a command-line override writes it: ``[8,8,16]``, ``true``, ``null``."""
    return show_value(value).replace(", ", ",")


def _kind_fix(kind: str, path: str) -> str:
    if kind == "stage1":
        learned = "|".join(encoding_configs(LearnedEncoding))
        return (f"to train latent diffusion on this stage 1, pass it as encoding.checkpoint={path} "
                f"(a latent experiment: encoding={learned} data=latents, with a cache from python cache_latents.py "
                f"stage1_ckpt={path} out=DIR); to resume a diffusion run, pass that run's checkpoints/last.ckpt as "
                "ckpt_path")
    if kind == "diffusion":
        return ("resume it with the experiment that trained it (a diffusion experiment, e.g. experiment=exp9_demo), "
                "or pass a stage-1 run's checkpoints/last.ckpt")
    return _RESUME_FIX


def _stored_config_error(path: str, err: ConfigError) -> ConfigError:
    return ConfigError("ckpt_path", path, f"its stored config is refused ({err})", _RESUME_FIX)


def architecture_differences(hparams: Mapping[str, Any], cfg: DictConfig, path: str,
                             spec: RunSpec | None = None) -> list[tuple[str, Any, Any]]:
    """``(key, in the checkpoint, now)`` for every architectural setting that differs (see the module docstring).

    The stored side is the system part the checkpoint's hyper-parameters resolve to
    (:func:`voxdiff.run.spec.system_spec`), the current side ``spec``'s (None: :func:`voxdiff.run.spec.run_spec` of
    ``cfg``), both for the same device."""
    spec = spec if spec is not None else run_spec(cfg)
    try:
        old_spec = system_spec(spec.kind, hparams, spec.device_type)
    except ConfigError as err:
        raise _stored_config_error(path, err) from None
    if spec.kind == "stage1":
        old, new = asdict(old_spec.vqvae), asdict(spec.vqvae)
        return [(f"system.vqvae.{k}", old[k], new[k]) for k in old if k not in VQVAE_TRAINING_KEYS and old[k] != new[k]]
    out: list[tuple[str, Any, Any]] = []
    encoding = spec.encoding  # a learned encoding's weights file may move: not architecture
    weights = encoding.weights_key.removeprefix("encoding.") if isinstance(encoding, LearnedEncoding) else None
    old_enc = {k: v for k, v in dict(hparams["encoding"]).items() if k != weights}
    new_enc = {k: v for k, v in plain(cfg.encoding).items() if k != weights}
    out += [(f"encoding.{k}", old_enc.get(k), new_enc.get(k)) for k in sorted(set(old_enc) | set(new_enc))
            if old_enc.get(k) != new_enc.get(k)]
    if old_spec.mode != spec.mode:
        out.append(("mode", old_spec.mode, spec.mode))
    if not out:  # same encoding and mode: the UNet's in/out channels agree, compare the rest of the UNet
        old, new = asdict(old_spec.unet), asdict(spec.unet)
        out += [(f"model.{k}", old[k], new[k]) for k in old if k not in RUNTIME_MODEL_KEYS and old[k] != new[k]]
    old_cov = [c["name"] for c in (hparams.get("covariates") or {}).get("columns", [])]
    new_cov = [name for name, _ in parse_covariates(OmegaConf.select(cfg, "data.covariates"))]
    if old_cov != new_cov:  # the covariate embedding's input: an architectural change
        out.append(("data.covariates", old_cov, new_cov))
    old_d, new_d = asdict(old_spec.recipe.diffusion), asdict(spec.recipe.diffusion)
    out += [(f"diffusion.{k}", old_d.get(k), new_d.get(k)) for k in PROCESS_KEYS if old_d.get(k) != new_d.get(k)]
    return out


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def setting_changes(stored: Mapping[str, Any] | None, current: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(applied, not applied): every setting whose value differs between the checkpoint's config and this one."""
    if not stored:
        return [], []
    old, new = _flatten(stored), _flatten(current)
    applied, not_applied = [], []
    for key in sorted(set(old) | set(new)):
        if any(fnmatch.fnmatchcase(key, p) for p in NOT_COMPARED) or old.get(key) == new.get(key):
            continue
        change = f"{key} {show_value(old.get(key))} → {show_value(new.get(key))}"
        if key in NOT_APPLIED:
            not_applied.append(f"{change} ({NOT_APPLIED[key]})")
        else:
            applied.append(change)
    return applied, not_applied


def check_resume(cfg: DictConfig, ckpt_path: str, spec: RunSpec | None = None) -> ResumePlan:
    """Check that ``cfg`` (whose run spec is ``spec``; None: built here) can continue the run saved in
    ``ckpt_path``; see the module docstring.

    Raises:
        ConfigError: the file cannot be read, is of the other system, or was trained with another architecture.
    """
    spec = spec if spec is not None else run_spec(cfg)
    ckpt = load_file(ckpt_path, "ckpt_path", _RESUME_FIX, mmap=True)
    kind, wanted = checkpoint_kind(ckpt), spec.kind
    if kind != wanted:
        raise ConfigError("ckpt_path", ckpt_path, f"is {KINDS[kind]}, but this run trains {_RUNS[wanted]}",
                          _kind_fix(kind, ckpt_path))
    bad = non_finite_tensor(ckpt)
    if bad is not None:
        raise ConfigError("ckpt_path", ckpt_path, f"its weight {bad} holds NaN or infinite values, which training "
                          "cannot continue from", "resume from an earlier checkpoint of the run (every checkpoint "
                          "voxdiff writes is finite), or start over with overwrite=true")
    hparams = ckpt["hyper_parameters"]
    diffs = architecture_differences(hparams, cfg, ckpt_path, spec)
    if diffs:
        raise ConfigError(
            "ckpt_path", ckpt_path,
            "was trained with another architecture, which its weights cannot continue: "
            + "; ".join(f"{k} is {show_value(old)} in the checkpoint and {show_value(new)} now" for k, old, new in diffs),
            "resume with the checkpoint's values (" + " ".join(f"{k}={_cli(old)}" for k, old, _ in diffs)
            + "), or train the new architecture as a new run (ckpt_path=null, another paths.run_dir)")
    old_wd = float((hparams.get("optim") or {}).get("weight_decay") or 0.0)
    new_wd = (spec.recipe.optim if spec.kind == "diffusion" else spec.stage1.optim).weight_decay
    if (old_wd == 0.0) != (new_wd == 0.0):
        raise ConfigError("system.optim.weight_decay", new_wd,
                          f"the checkpoint's optimizer was built with weight_decay {old_wd:g}; switching between 0 "
                          "and a positive value changes its parameter groups, which a resume cannot map",
                          f"resume with system.optim.weight_decay={old_wd:g}" if old_wd == 0.0 else
                          "resume with a positive system.optim.weight_decay")
    current = {k: plain(cfg[k]) for k in cfg if k != "hydra"}
    applied, not_applied = setting_changes(ckpt.get(CONFIG_KEY), current)
    return ResumePlan(str(ckpt_path), int(ckpt.get("global_step", 0)), applied, not_applied,
                      covariates=hparams.get("covariates") or None)


def check_weights_fit(system: L.LightningModule, checkpoint: Mapping[str, Any]) -> None:
    """Refuse, in one line naming the keys, a resume whose checkpoint holds weights of other names or shapes than
    the model this config built (a checkpoint from another version, or edited by hand: the config it stores can
    agree while its tensors do not). Called from the systems' ``on_load_checkpoint``, which Lightning runs before it
    loads the weights; on one device and under DDP only: a sharded strategy (``trainer=fsdp``) loads its weights
    its own way, and Lightning's error stands there.

    Raises:
        ConfigError: naming ``ckpt_path``, the file and the differing keys.
    """
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    trainer = system._trainer
    if trainer is None or not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
        return
    diff = weights_differences(system.state_dict(), checkpoint)
    if diff is not None:
        raise ConfigError("ckpt_path", trainer.ckpt_path, f"its weights do not fit the model this config builds "
                          f"({diff})", _RESUME_FIX)


_OPTIM_NAMES = {"lr": "system.optim.lr", "betas": "system.optim.betas", "eps": "system.optim.eps",
                "weight_decay": "system.optim.weight_decay", "foreach": "system.optim.foreach",
                "fused": "system.optim.fused", "warmup_steps": "system.optim.warmup_steps",
                "decay_steps": "system.optim.decay_steps (null: the run length)",
                "min_lr_ratio": "system.optim.min_lr_ratio"}


class FollowCurrentOptimizer(L.Callback):
    """On resume, the optimizer and the LR schedule follow the *current* ``system.optim``.

    Lightning restores the optimizer's and the scheduler's state dicts, hyper-parameters included, so a new
    ``system.optim.lr`` would be silently ignored. This captures the hyper-parameters of the freshly configured
    optimizer and schedule (``on_fit_start``, before Lightning restores the checkpoint's) and puts them back over
    the restored state (``on_train_start``): the Adam moments and the step count stay the checkpoint's; the base
    learning rate, betas, eps, weight decay and the warm-up/cosine shape (decay length included) are the
    config's, and the learning rate continues at the current step of the new schedule.
    """

    def __init__(self) -> None:
        self._groups: list[list[dict[str, Any]]] = []
        self._schedulers: list[dict[str, Any]] = []
        self.changes: list[str] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._groups = [copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
                        for opt in trainer.optimizers]
        self._schedulers = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        changes: dict[str, str] = {}
        for opt, fresh in zip(trainer.optimizers, self._groups):
            for group, new in zip(opt.param_groups, fresh):
                for k, v in new.items():
                    if k not in ("lr", "initial_lr") and group.get(k) != v:
                        changes.setdefault(k, f"{group.get(k)} → {v}")
                        group[k] = v
        for config, fresh in zip(trainer.lr_scheduler_configs, self._schedulers):
            sched = config.scheduler
            new_base = list(fresh.get("base_lrs", sched.base_lrs))
            new_fns = fresh.get("lr_lambdas") or []
            old_fns = [dict(getattr(fn, "__dict__", {})) for fn in getattr(sched, "lr_lambdas", [])]
            if list(sched.base_lrs) == new_base and all(d is None or d == o for d, o in zip(new_fns, old_fns)):
                continue
            if list(sched.base_lrs) != new_base:
                changes["lr"] = f"{sched.base_lrs[0]:g} → {new_base[0]:g}"
            for old, new in zip(old_fns, new_fns):
                for k, v in (new or {}).items():
                    if old.get(k) != v:
                        changes.setdefault(k, f"{old.get(k)} → {v}")
            sched.base_lrs = new_base
            for fn, d in zip(getattr(sched, "lr_lambdas", []), new_fns):
                if d is not None:
                    fn.__dict__.update(d)
            lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
            for group, lr, base in zip(sched.optimizer.param_groups, lrs, sched.base_lrs):
                group["lr"], group["initial_lr"] = lr, base
            sched._last_lr = lrs
        self.changes = [f"{_OPTIM_NAMES.get(k, k)} {v}" for k, v in changes.items()]
        if self.changes and trainer.is_global_zero:
            print("[voxdiff] resume: the optimizer follows the current config: " + "; ".join(self.changes), flush=True)
