"""``voxdiff.data.shared``: one rank writes what every rank reads, the others wait for it — the helper with real
processes, and its users (template subjects, the NIfTI disk cache, a multi-process cache_latents)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from voxdiff.data.shared import launch_rank, one_writes


def _rank(rank: int, folder: str, queue) -> None:
    import os
    from pathlib import Path

    os.environ["LOCAL_RANK"] = str(rank)
    out, marker = Path(folder) / "data", Path(folder) / "done"

    def write() -> str:
        with open(Path(folder) / "writers", "a") as f:
            f.write(f"{rank}\n")
        time.sleep(0.5)  # a slow writer: a rank that did not wait would find nothing
        out.write_text("payload")
        marker.write_text("")
        return "wrote"

    result = one_writes(write, marker.is_file, "the test data", poll_s=0.02)
    queue.put((rank, result, out.read_text()))


def test_rank_zero_writes_and_the_others_read_after_it(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), queue)) for r in (1, 2, 0)]  # waiters first
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = sorted(queue.get(timeout=5) for _ in procs)
    assert results == [(0, "wrote", "payload"), (1, None, "payload"), (2, None, "payload")]
    assert (tmp_path / "writers").read_text() == "0\n"  # written once


def test_a_writer_that_never_finishes_is_reported(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(TimeoutError, match="rank 1 waited 0 s for rank 0 of the node to write the cache"):
        one_writes(lambda: None, lambda: False, "the cache", timeout_s=0.1, poll_s=0.01)


@pytest.mark.parametrize(("env", "node", "world"), [({}, 0, 0), ({"LOCAL_RANK": "1", "RANK": "5"}, 1, 5),
                                                     ({"SLURM_LOCALID": "2", "SLURM_PROCID": "3"}, 2, 3)])
def test_launch_rank_reads_the_launchers(env, node, world, monkeypatch):
    for name in ("LOCAL_RANK", "RANK", "SLURM_LOCALID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (launch_rank("node"), launch_rank("world")) == (node, world)


def test_template_subjects_are_waited_for_not_written_by_other_ranks(tmp_path, monkeypatch):
    from voxdiff.data import mni_template

    made = []
    monkeypatch.setattr(mni_template, "make_subject", lambda *a: made.append(a))  # must not be called
    monkeypatch.setenv("LOCAL_RANK", "1")
    roots = []
    args = (tmp_path, "mni152_2009", 3.0, 2, 0)
    waiter = threading.Thread(target=lambda: roots.append(mni_template.subject_folder(*args)), daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not roots  # waiting for rank 0's settings.json
    root = mni_template.subject_root(*args)
    root.mkdir(parents=True)
    (root / "settings.json").write_text("{}")  # what rank 0 writes last
    waiter.join(10)
    assert roots == [root] and not made
