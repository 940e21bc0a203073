"""A CSV logger that continues its metrics file when a run resumes, instead of deleting it.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` in its version folder when it starts
(lightning#19446, since 2.2: "Previous log files in this directory will be deleted"). voxdiff pins the version of
a Slurm job to its job id (``configs/logger/csv.yaml``), so a requeued job writes into the same folder, and that
deletion wiped the first half of every requeued run. Lightning already writes the file after every logged step,
so what was on disk at the preemption is every step logged up to then; this logger keeps it.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued.

    Its header seeds the known keys (a key new in this run rewrites the file with every old row, as Lightning does
    within one run). The first step this process logs is where the resumed run took over: rows from that step on
    were logged after the checkpoint it resumed from, by work that is now done again, and are dropped (the file is
    rewritten through a temporary file and a rename).
    """

    def _check_log_dir_exists(self) -> None:  # called by the base __init__ instead of deleting the old file
        self._continued = False
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            header = next(csv.reader(f), None)
        if header:
            self.metrics_keys = sorted(header)
            self._continued = True

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        if self._continued and step is not None:
            self._drop_rows_from(int(step))
        self._continued = False
        super().log_metrics(metrics_dict, step)

    def _drop_rows_from(self, step: int) -> None:
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            rows = list(csv.DictReader(f))
        kept = [r for r in rows if _step_of(r) is not None and _step_of(r) < step]
        if len(kept) == len(rows):
            return
        tmp = f"{self.metrics_file_path}.{os.getpid()}.tmp"
        with self._fs.open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(kept)
        self._fs.mv(tmp, self.metrics_file_path)


def _step_of(row: dict[str, str]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None  # a row cut short by a kill mid-write


class ContinuingCSVLogger(CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` whose ``metrics.csv`` survives a resume into the same version.

    Same arguments as Lightning's. With ``version`` pinned (a Slurm job's id), a requeued job appends to the
    metrics of its first half; rows logged after the checkpoint it resumed from are replaced by the redone steps,
    so the file holds each logged step once.
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return self._experiment
