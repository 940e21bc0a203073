"""How a run is spread over GPUs (``trainer.strategy``, ``devices``, ``num_nodes``): the run spec's
:attr:`~voxdiff.run.spec.RunSpec.parallel`. What one rank of it holds is traced by
:mod:`voxdiff.preflight.distributed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from voxdiff.config import processes, strategy_kind

__all__ = ["Parallel", "parallel_of"]


@dataclass(frozen=True)
class Parallel:
    """How a run is spread over GPUs, as far as one rank's memory is concerned.

    Attributes:
        strategy: ``single`` (one process, or a strategy the preflight does not model), ``ddp`` or ``fsdp``.
        world_size: processes (GPUs) over all nodes.
        processes_per_node: processes on one node (host memory per node).
        gradient_as_bucket_view: DDP's gradients are views into its all-reduce buckets.
        bucket_cap_mb: DDP's bucket size in MiB.
    """

    strategy: str = "single"
    world_size: int = 1
    processes_per_node: int = 1
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float = 25.0

    @property
    def distributed(self) -> bool:
        """More than one process, with a strategy whose ranks the preflight traces."""
        return self.strategy != "single" and self.world_size > 1

    def describe(self) -> str:
        """``one GPU``, ``fsdp×4`` or ``ddp×2 (gradient_as_bucket_view=..., bucket_cap_mb=...)``."""
        if self.strategy == "ddp":
            return (f"ddp×{self.world_size} (gradient_as_bucket_view={str(self.gradient_as_bucket_view).lower()}, "
                    f"bucket_cap_mb={self.bucket_cap_mb:g})")
        return f"{self.strategy}×{self.world_size}" if self.distributed else "one GPU"


def parallel_of(trainer: Mapping[str, Any]) -> Parallel:
    """The :class:`Parallel` of a plain ``trainer:`` config: the strategy's kind
    (:func:`voxdiff.config.strategy_kind`: ``trainer.strategy.kind`` of ``trainer=ddp`` / ``trainer=fsdp``; a
    strategy name as Lightning registers it, ``auto`` counting as DDP with torch's defaults; others, e.g.
    ``deepspeed``, are traced as one GPU)."""
    strategy = trainer.get("strategy") or "auto"
    name = strategy_kind(strategy)
    # a strategy named, not configured: Lightning's DDP, i.e. DistributedDataParallel's own default
    options = dict(strategy) if isinstance(strategy, Mapping) else {"gradient_as_bucket_view": False}
    per_node, world = processes(trainer)
    return Parallel(name if world > 1 else "single", world, per_node,
                    bool(options.get("gradient_as_bucket_view", True)), float(options.get("bucket_cap_mb", 25.0)))
