"""Multi-GPU pieces: a replica-consistency check for DDP and the FSDP strategy for MONAI's UNet.

Batch size and learning rate under DDP: ``data.batch_size`` is per process (per GPU); the effective batch is
``batch_size × devices × num_nodes × trainer.accumulate_grad_batches``. ``system.optim.lr`` is used as given (no
automatic scaling): when you multiply the effective batch by k, scale the learning rate yourself (linearly for
small k, by √k for large k, as is usual for AdamW).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch


def parameter_checksum(module: torch.nn.Module) -> torch.Tensor:
    """A (2,) float64 fingerprint of the parameters: the sum and the sum of squares of all entries."""
    total = torch.zeros(2, dtype=torch.float64)
    for p in module.parameters():
        d = p.detach().to(torch.float64).cpu()
        total += torch.stack((d.sum(), d.square().sum()))
    return total


class ReplicaConsistency(L.Callback):
    """Check at the end of training that every DDP replica holds the same weights.

    Gathers :func:`parameter_checksum` from all ranks, writes them to ``<run dir>/replicas.json`` on rank 0 and
    raises if two replicas differ by more than ``rtol`` (a desynchronised replica trains silently otherwise).

    Args:
        rtol: relative tolerance of the comparison (DDP all-reduces gradients, so replicas agree to rounding).
        filename: the report, relative to ``trainer.default_root_dir``.
    """

    def __init__(self, rtol: float = 1e-9, filename: str = "replicas.json") -> None:
        self.rtol = rtol
        self.filename = filename

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        local = parameter_checksum(pl_module).to(pl_module.device)
        gathered = trainer.strategy.all_gather(local)  # (world, 2), or (2,) with one process
        sums = gathered.reshape(-1, 2).cpu().tolist()
        if trainer.is_global_zero:
            report = {"world_size": trainer.world_size, "global_step": trainer.global_step, "checksums": sums}
            path = Path(trainer.default_root_dir) / self.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2))
        reference = torch.tensor(sums[0], dtype=torch.float64)
        for rank, values in enumerate(sums):
            if not torch.allclose(torch.tensor(values, dtype=torch.float64), reference, rtol=self.rtol, atol=0.0):
                raise RuntimeError(f"DDP replica {rank} holds different weights from replica 0 "
                                   f"({values} vs {sums[0]}): the processes desynchronised")


def fsdp_strategy(**kwargs) -> L.pytorch.strategies.FSDPStrategy:
    """Lightning's FSDP strategy, sharding MONAI's UNet per resnet and attention block (full shard).

    Parameters, gradients and AdamW's state are split over the GPUs; each block's weights are gathered just in
    time for its forward and backward. Use it when those states crowd out one GPU (``trainer=fsdp``); the preflight
    accounts for the sharding (``voxdiff.preflight.check.per_gpu_peak``).
    """
    from lightning.pytorch.strategies import FSDPStrategy
    from monai.networks.blocks.spatialattention import SpatialAttentionBlock
    from monai.networks.nets.diffusion_model_unet import DiffusionUNetResnetBlock

    kwargs.setdefault("sharding_strategy", "FULL_SHARD")
    kwargs.setdefault("auto_wrap_policy", {DiffusionUNetResnetBlock, SpatialAttentionBlock})
    return FSDPStrategy(**kwargs)
