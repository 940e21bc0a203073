"""The CSV logger of a resumed run continues its metrics.csv (Lightning's deletes it when the folder is reopened)."""

import csv

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from voxdiff.lightning.loggers import CSVLogger


def _two_runs(cls, root) -> list[dict[str, str]]:
    first = cls(root, name="csv", version="job-7")
    first.log_metrics({"train/loss": 1.0}, step=4)
    first.finalize("failed")  # a run stopped by SIGTERM
    resumed = cls(root, name="csv", version="job-7")  # the requeued job: same version
    resumed.log_metrics({"train/loss": 0.5, "lr": 0.1}, step=9)
    resumed.finalize("success")
    with open(root / "csv" / "job-7" / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_resumed_run_appends_to_its_metrics(tmp_path):
    rows = _two_runs(CSVLogger, tmp_path / "voxdiff")
    assert [(r["step"], r["train/loss"], r["lr"]) for r in rows] == [("4", "1.0", ""), ("9", "0.5", "0.1")]
    # what Lightning's own logger does with the same two runs: the first run's rows are gone
    assert [r["step"] for r in _two_runs(LightningCSVLogger, tmp_path / "lightning")] == ["9"]
