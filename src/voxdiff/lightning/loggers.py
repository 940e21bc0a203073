"""A CSV logger that continues its file when a run resumes (``logger=csv``, ``logger=wandb_csv``).

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when a writer opens its folder again, so a resumed
run (a requeued Slurm job continues the same ``version``) kept only the rows it logged itself — none at all if it
stopped before its next logging step. :class:`CSVLogger` keeps the file and appends to it (a new metric rewrites
the header with the old rows kept, as Lightning does within one run). After a hard crash, rows logged after the
resumed checkpoint's step appear twice (the ``step`` column tells them apart); nothing is lost.
"""

from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):  # continue it: its header is the metric keys so far
            with self._fs.open(self.metrics_file_path, "r", newline="") as fh:
                self.metrics_keys = list(next(csv.reader(fh), []))


class CSVLogger(_LightningCSVLogger):
    """Lightning's ``CSVLogger`` that appends to the ``metrics.csv`` of its version instead of deleting it."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
