"""``ContinuingCSVLogger``: a resumed run continues its metrics file (Lightning's CSVLogger deletes it)."""

import csv

from lightning.pytorch.loggers import CSVLogger
from voxdiff.lightning.csv_logger import ContinuingCSVLogger


def _rows(logger) -> list[dict[str, str]]:
    with open(logger.experiment.metrics_file_path, newline="") as f:
        return list(csv.DictReader(f))


def _first_half(cls, tmp_path):
    first = cls(save_dir=str(tmp_path), name="csv", version="job-7")
    for step in range(9):  # steps 6..8 were logged after the checkpoint at step 6 and die with the process
        first.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
        first.save()
    return first


def test_a_resumed_run_continues_the_file_and_redoes_the_steps_after_its_checkpoint(tmp_path):
    _first_half(ContinuingCSVLogger, tmp_path)
    second = ContinuingCSVLogger(save_dir=str(tmp_path), name="csv", version="job-7")
    for step in range(6, 12):  # resumed from the checkpoint at step 6
        second.log_metrics({"train/loss": 0.5, "val/loss": 0.25}, step=step)  # a key new in this half
        second.save()
    rows = _rows(second)
    assert [int(r["step"]) for r in rows] == list(range(12))  # each step once, in order
    assert [r["val/loss"] for r in rows[:6]] == [""] * 6 and {r["val/loss"] for r in rows[6:]} == {"0.25"}
    assert float(rows[5]["train/loss"]) == 1.0 / 6 and float(rows[6]["train/loss"]) == 0.5
    assert not list(tmp_path.rglob("*.tmp"))


def test_lightning_csv_logger_deletes_the_first_half(tmp_path):
    """Why voxdiff has its own: with Lightning's logger the same resume keeps only the second half."""
    _first_half(CSVLogger, tmp_path)
    second = CSVLogger(save_dir=str(tmp_path), name="csv", version="job-7")
    second.log_metrics({"train/loss": 0.5}, step=6)
    second.save()
    assert [int(r["step"]) for r in _rows(second)] == [6]


def test_a_fresh_folder_and_a_row_cut_short_are_handled(tmp_path):
    fresh = ContinuingCSVLogger(save_dir=str(tmp_path), name="csv", version="a")
    fresh.log_metrics({"x": 1.0}, step=0)
    fresh.save()
    assert [r["step"] for r in _rows(fresh)] == ["0"]
    path = fresh.experiment.metrics_file_path
    with open(path, "a") as f:
        f.write("2.0,")  # a write cut short by a kill
    resumed = ContinuingCSVLogger(save_dir=str(tmp_path), name="csv", version="a")
    resumed.log_metrics({"x": 3.0}, step=1)
    resumed.save()
    assert [(r["step"], r["x"]) for r in _rows(resumed)] == [("0", "1.0"), ("1", "3.0")]
