"""``python train.py [experiment=NAME] [key=value ...]``: compose → validate → instantiate → fit → report.

The system comes from ``cfg.system`` (the diffusion UNet, or the VQ-VAE's stage 1), the data from ``cfg.data``;
all outputs go to the run directory (``paths.output_dir``): ``checkpoints/``, ``samples/``, ``wandb/`` or
``csv/``, and Hydra's ``.hydra/`` config record.

Exit codes: 0 done; 2 the config was refused (nothing was built); 3 training stopped on a NaN/inf loss.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from voxdiff.config import build_encoding, config_dir, is_diffusion, model_spec, plain, shapes
from voxdiff.errors import ConfigError

log = logging.getLogger("voxdiff.train")

EXIT_CONFIG = 2
EXIT_NONFINITE = 3


def validate(cfg: DictConfig) -> None:
    """The static checks of a training config, run before anything is built (no model, no data, no GPU).

    Raises:
        ConfigError: the first key that cannot work, with its value and a fix.
    """
    from voxdiff.step import accelerator_device, decide_precision

    encoding = build_encoding(cfg)
    shapes(cfg, encoding)  # volume divisible by the encoding's factor
    model_spec(cfg, encoding)  # the UNet's arguments
    decide_precision(plain(cfg.trainer.get("precision")), accelerator_device(cfg.trainer.get("accelerator")))
    if is_diffusion(cfg):
        from voxdiff.lightning.diffusion import system_settings
        from voxdiff.preflight.rules import validate as static_rules
        from voxdiff.step import recipe_from_config

        static_rules(cfg)  # the preflight's static rules: divisibility by the UNet's levels, in/out channels, ...
        recipe_from_config(cfg, "system")  # the training step: diffusion, system.optim/.ema, trainer clipping
        system_settings(plain(cfg.system.get("optim")), plain(cfg.system.get("ema")),
                        plain(cfg.system.get("sampling")), plain(cfg.system.get("val_timesteps", 4)))
    ckpt = cfg.get("ckpt_path")
    if ckpt is not None and ckpt not in ("auto", "last") and "://" not in str(ckpt) and not Path(str(ckpt)).is_file():
        raise ConfigError("ckpt_path", ckpt, "no such checkpoint file",
                          "point it at a .ckpt, e.g. <run dir>/checkpoints/last.ckpt, ckpt_path=auto (resume from "
                          "this run directory if it has a checkpoint), or ckpt_path=null")


def resume_path(ckpt_path: Any, run_dir: Path) -> str | None:
    """``ckpt_path`` as ``trainer.fit`` takes it. ``auto``: the newest of this run directory's preemption checkpoint
    (``hpc_ckpt_N.ckpt``, written by Lightning's SLURM environment on SIGUSR1) and ``checkpoints/last.ckpt``, or
    None when there is neither (a fresh start). A requeued Slurm job resumes this way."""
    if ckpt_path != "auto":
        return None if ckpt_path is None else str(ckpt_path)
    candidates = [p for p in [*run_dir.glob("hpc_ckpt_*.ckpt"), run_dir / "checkpoints" / "last.ckpt"] if p.is_file()]
    return str(max(candidates, key=lambda p: p.stat().st_mtime)) if candidates else None


def _one_console_log() -> None:
    """Under Hydra's logging, Lightning's own console handler prints every message a second time: drop it."""
    if logging.getLogger().handlers:
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if type(handler) is logging.StreamHandler:
                    logger.removeHandler(handler)
            logger.propagate = True


def run(cfg: DictConfig) -> dict[str, Any]:
    """Build the data, the system, the logger and the Trainer from a validated config, fit, and report.

    Returns:
        ``{"run_dir", "metrics", "last_checkpoint", "best_checkpoint"}`` (metrics as floats).
    """
    import lightning as L
    import torch
    from hydra.utils import instantiate

    from voxdiff.lightning.callbacks import ConfigInCheckpoint
    from voxdiff.lightning.diffusion import NonFiniteLossError
    from voxdiff.lightning.trainer import (
        build_trainer,
        configure_cpu_threads,
        instantiate_callbacks,
        instantiate_loggers,
    )

    _one_console_log()
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("LOCAL_RANK", "0"))) or 0)
    L.seed_everything(int(cfg.seed) + rank, workers=True)  # DDP broadcasts rank 0's initial weights
    threads = configure_cpu_threads()
    run_dir = Path(cfg.paths.output_dir)
    log.info("run directory: %s", run_dir.resolve())
    print(f"[voxdiff] run directory: {run_dir.resolve()}  (torch threads: {threads})", flush=True)

    from hydra.errors import InstantiationException

    try:
        datamodule = instantiate(cfg.data, _convert_="all")
        system = instantiate(cfg.system)
    except InstantiationException as e:  # a constructor refused its config: surface that refusal, not Hydra's
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise
    logger = instantiate_loggers(cfg.get("logger"))
    record = {k: plain(cfg[k]) for k in cfg if k != "hydra"}  # the resolved config, for sample.py
    callbacks = [*instantiate_callbacks(cfg.get("callbacks")), ConfigInCheckpoint(record)]
    trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=logger)
    ckpt_path = resume_path(cfg.get("ckpt_path"), run_dir)
    if ckpt_path is not None:
        step = torch.load(ckpt_path, map_location="cpu", weights_only=False).get("global_step", "?")
        print(f"[voxdiff] resuming from {ckpt_path} (step {step})", flush=True)
    try:
        trainer.fit(system, datamodule=datamodule, ckpt_path=ckpt_path)
    except NonFiniteLossError as e:
        last = [c.last_model_path for c in trainer.checkpoint_callbacks if getattr(c, "last_model_path", "")]
        e.args = (f"{e}. The last good checkpoint: {last[0] if last else 'none was written yet'}",)
        raise
    finally:
        if any(type(lg).__name__ == "WandbLogger" for lg in trainer.loggers):
            import wandb

            wandb.finish(exit_code=0 if trainer.state.status.value == "finished" else 1)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    ckpts = {type(c).__name__: c for c in trainer.checkpoint_callbacks}
    report = {
        "run_dir": str(run_dir.resolve()),
        "metrics": metrics,
        "last_checkpoint": getattr(ckpts.get("LastCheckpoint"), "last_model_path", "") or None,
        "best_checkpoint": getattr(ckpts.get("ModelCheckpoint"), "best_model_path", "") or None,
    }
    print(f"[voxdiff] done: {trainer.global_step} steps; " + ", ".join(f"{k}={v:.4g}" for k, v in
          sorted(metrics.items())), flush=True)
    print(f"[voxdiff] last checkpoint: {report['last_checkpoint']}\n[voxdiff] run directory: {report['run_dir']}",
          flush=True)
    return report


def train(cfg: DictConfig) -> dict[str, Any]:
    """validate → run, with the exits of the command line: a refused config or a NaN stop prints one clear
    message (no traceback) and exits non-zero."""
    from voxdiff.lightning.diffusion import NonFiniteLossError

    try:
        validate(cfg)
    except ConfigError as e:
        print(f"[voxdiff] config error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG) from None
    try:
        return run(cfg)
    except NonFiniteLossError as e:
        print(f"[voxdiff] training stopped: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_NONFINITE) from None
    except ConfigError as e:  # a check that needs the built objects (e.g. the run length)
        print(f"[voxdiff] config error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG) from None


@hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """The ``voxdiff-train`` / ``python train.py`` entry point; returns the last ``val/loss`` (for sweepers)."""
    return train(cfg)["metrics"].get("val/loss")


if __name__ == "__main__":
    main()
