"""Checkpoints written atomically: a crash or a SLURM kill mid-write never leaves a truncated ``last.ckpt``.

:class:`AtomicCheckpointIO` is Lightning's side of :func:`voxdiff.files.atomic_torch_save` (a temporary file,
``fsync``, ``os.replace``; refused up front, or reported as :class:`~voxdiff.files.CheckpointWriteError`, when the
disk lacks the room). Non-local paths (``s3://`` …) fall back to Lightning's own writer.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

from voxdiff.files import atomic_torch_save


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` plugin that writes checkpoints with :func:`atomic_torch_save`.

    ``Trainer(plugins=[AtomicCheckpointIO()])``; loading and removal are Lightning's.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        if not _is_local_file_protocol(str(path)):
            super().save_checkpoint(checkpoint, path)
            return
        atomic_torch_save(checkpoint, path)
