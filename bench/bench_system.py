"""Step time of the Lightning diffusion system against a plain PyTorch loop, measured in the same process.

    python bench/bench_system.py [--steps 20] [--warmup 3] [--repeats 4] [--logger wandb|csv|none] [override ...]

Both sides train the same model (same initial weights) on the same batches (the same DataLoader of the same data
module) with the same training step, :class:`voxdiff.step.TrainStep` (loss, AdamW and LR schedule, clipping, the
non-finite guard, EMA): the Lightning side is ``trainer.fit`` of the system that drives it, through
``voxdiff.cli.train``'s own Trainer factory with the shipped callbacks and logging (``--logger``: the shipped
default is wandb offline); the plain side calls ``TrainStep.run`` in a loop. Validation is off on both sides. A callback / the loop records the wall time of every step (data loading
included); the first ``--warmup`` steps are dropped. The sides alternate ``--repeats`` times (which side goes first
alternates too) so drift in machine load hits both, and each repeat checks that both sides ended with the same
weights. Goal: Lightning within 5% of the plain loop (ratio of medians). On a shared machine other processes move
single runs by ±10%; the 10th-percentile ratio is the one least disturbed by them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import lightning as L
import torch
from hydra.utils import instantiate

from voxdiff.config import compose
from voxdiff.lightning.trainer import (
    build_trainer,
    configure_cpu_threads,
    instantiate_callbacks,
    instantiate_loggers,
)
from voxdiff.step import TrainStep, accelerator_device, decide_precision, recipe_from_config


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.times.append(time.perf_counter())


def _intervals(times: list[float], start: float, warmup: int) -> list[float]:
    stamps = [start, *times]
    return [b - a for a, b in zip(stamps, stamps[1:])][warmup:]


def lightning_steps(
    cfg, datamodule, steps: int, warmup: int, logger_kind: str, out: str
) -> tuple[list[float], torch.nn.Module]:
    L.seed_everything(int(cfg.seed))
    system = instantiate(cfg.system)
    logger = False
    if logger_kind != "none":
        logger = instantiate_loggers(compose("train", [f"logger={logger_kind}", f"paths.output_dir={out}"]).logger)
    timer = StepTimer()
    callbacks = [*instantiate_callbacks(cfg.callbacks), timer]
    trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=logger, max_steps=warmup + steps,
                            max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_progress_bar=True, enable_model_summary=False)
    start = []

    class Start(L.Callback):
        def on_train_start(self, *args):
            start.append(time.perf_counter())

    trainer.callbacks.append(Start())
    trainer.fit(system, datamodule=datamodule)
    if logger_kind == "wandb":
        import wandb

        wandb.finish()
    return _intervals(timer.times, start[0], warmup), system.model


def plain_steps(cfg, datamodule, steps: int, warmup: int) -> tuple[list[float], torch.nn.Module]:
    """The same step without Lightning: ``TrainStep.run`` (encode → loss → backward → clip → AdamW → EMA → LR)."""
    L.seed_everything(int(cfg.seed))
    system = instantiate(cfg.system)  # the same model, encoding and process objects, used without a Trainer
    device = accelerator_device(cfg.trainer.accelerator)
    system.to(device).train()
    precision = decide_precision(cfg.trainer.precision, device)
    step = TrainStep(system.model, recipe_from_config(cfg, "system"), encoding=system.encoding, mode=system.mode,
                     process=system.process, precision=precision.context(), device_type=device)
    step.configure_optimizer(total_steps=warmup + steps)
    datamodule.setup("fit")
    times, done = [], 0
    start = time.perf_counter()
    while done < warmup + steps:
        for batch in datamodule.train_dataloader():
            step.run({k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
            times.append(time.perf_counter())
            done += 1
            if done == warmup + steps:
                break
    return _intervals(times, start, warmup), system.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--logger", choices=("wandb", "csv", "none"), default="wandb")
    parser.add_argument("overrides", nargs="*", default=["experiment=demo"], help="train.py overrides")
    args = parser.parse_args()
    threads = configure_cpu_threads()
    with tempfile.TemporaryDirectory() as out:
        cfg = compose("train", [*args.overrides, f"paths.output_dir={out}"])
        print(f"bench_system: {' '.join(args.overrides)}; {args.steps} steps after {args.warmup} warm-up, "
              f"{args.repeats} repeats, logger={args.logger}, torch threads={threads}, "
              f"device={'cuda' if torch.cuda.is_available() else 'cpu'}", flush=True)
        datamodule = instantiate(cfg.data, _convert_="all")  # one data module (and data cache) for both sides
        datamodule.setup("fit")
        plain, lightning = [], []
        for r in range(args.repeats):
            if r % 2 == 0:  # alternate which side goes first
                p, plain_model = plain_steps(cfg, datamodule, args.steps, args.warmup)
                lt, lightning_model = lightning_steps(cfg, datamodule, args.steps, args.warmup, args.logger, out)
            else:
                lt, lightning_model = lightning_steps(cfg, datamodule, args.steps, args.warmup, args.logger, out)
                p, plain_model = plain_steps(cfg, datamodule, args.steps, args.warmup)
            diff = max((a.detach() - b.detach()).abs().max().item()
                       for a, b in zip(plain_model.parameters(), lightning_model.parameters()))
            print(f"  repeat {r}: the same computation: final weights differ by at most {diff:.3g}", flush=True)
            print(f"  repeat {r}: plain median {statistics.median(p) * 1e3:.1f} ms/step, "
                  f"lightning median {statistics.median(lt) * 1e3:.1f} ms/step", flush=True)
            plain += p
            lightning += lt
    def p10(x: list[float]) -> float:
        return statistics.quantiles(x, n=10)[0]

    for name, x in (("plain loop", plain), ("lightning ", lightning)):
        print(f"{name}: median {statistics.median(x) * 1e3:7.1f} ms/step   10th percentile {p10(x) * 1e3:7.1f}   "
              f"mean {statistics.fmean(x) * 1e3:7.1f}   (n={len(x)})")
    ratio = statistics.median(lightning) / statistics.median(plain)
    print(f"ratio lightning/plain: {ratio:.3f} (medians), {p10(lightning) / p10(plain):.3f} (10th percentiles: "
          f"least disturbed by other load); goal <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
