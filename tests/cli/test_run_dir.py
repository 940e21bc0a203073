"""The run directory (voxdiff.cli.run_dir): one run at a time, stale locks replaced, no fresh run over checkpoints,
stale temporary files of interrupted checkpoint writes removed — and a refused run leaves the running one's
``.hydra/`` record alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from voxdiff.errors import ConfigError
from voxdiff.cli.run_dir import LOCK_NAME, checkpoints_in, claim, release


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _lock(run_dir, **fields) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getppid(), "host": socket.gethostname(), "started": "then", "command": "python train.py",
              "slurm_job_id": None, **fields}
    (run_dir / LOCK_NAME).write_text(json.dumps(record))


def test_claim_locks_and_release_unlocks(tmp_path):
    assert claim(tmp_path, None) == []
    info = json.loads((tmp_path / LOCK_NAME).read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert claim(tmp_path, None) == []  # idempotent in one process (the Hydra callback, then train())
    release(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("stale, reason", [
    ({"pid": "dead"}, "no longer exists"),
    ({"slurm_job_id": "4242", "host": "another-node"}, "an earlier run of this Slurm job 4242"),
])
def test_a_stale_lock_is_replaced_and_said(stale, reason, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _lock(tmp_path, **{k: (_dead_pid() if v == "dead" else v) for k, v in stale.items()})
    notes = claim(tmp_path, None)
    try:
        assert len(notes) == 1 and "removed a stale lock" in notes[0] and reason in notes[0]
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        release(tmp_path)


def test_a_live_lock_or_one_from_another_host_is_respected(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _lock(tmp_path / "here")  # our parent process: alive, on this host
    with pytest.raises(ConfigError) as err:
        claim(tmp_path / "here", None)
    assert err.value.key == "paths.run_dir" and f"pid {os.getppid()} on {socket.gethostname()}" in str(err.value)
    _lock(tmp_path / "there", host="another-node", pid=_dead_pid())  # cannot be checked from here
    with pytest.raises(ConfigError) as err:
        claim(tmp_path / "there", None)
    assert f"delete {tmp_path / 'there' / LOCK_NAME}" in str(err.value)
    assert json.loads((tmp_path / "there" / LOCK_NAME).read_text())["host"] == "another-node"  # left alone


def test_checkpoints_are_protected_from_a_fresh_run_and_from_another_runs_resume(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (run / "hpc_ckpt_2.ckpt").write_bytes(b"x")
    assert {p.name for p in checkpoints_in(run)} == {"last.ckpt", "hpc_ckpt_2.ckpt"}
    for ckpt_path, words in ((None, "ckpt_path=auto"), (str(tmp_path / "other" / "last.ckpt"), "continues another run")):
        with pytest.raises(ConfigError) as err:
            claim(run, ckpt_path)
        assert words in str(err.value) and "overwrite=true" in str(err.value)
        assert not (run / LOCK_NAME).exists()  # a refusal gives the lock back
    for ckpt_path, overwrite in (("auto", False), (str(run / "checkpoints" / "last.ckpt"), False), (None, True)):
        claim(run, ckpt_path, overwrite)  # resuming this run, or starting over on purpose
        release(run)


def test_stale_temporary_files_are_removed_and_said(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    stale = [tmp_path / "checkpoints" / ".last.ckpt.k2j_8x1q.tmp", tmp_path / ".hpc_ckpt_1.ckpt.abc123zz.tmp"]
    kept = [tmp_path / "checkpoints" / "notes.tmp", tmp_path / ".other.tmp", tmp_path / "checkpoints" / "x.ckpt"]
    for p in [*stale, *kept]:
        p.write_bytes(b"partial")
    notes = claim(tmp_path, str(tmp_path / "checkpoints" / "x.ckpt"))
    release(tmp_path)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
    assert "removed 2 temporary file(s) of interrupted checkpoint writes" in notes[-1]


def test_a_second_train_py_on_a_running_runs_directory_stops_before_hydra_writes(tiny_demo, tmp_path, monkeypatch,
                                                                                   capsys):
    """Through the real entry point: the Hydra callback refuses before .hydra/ is written, so the first run's
    config record stays as it was."""
    from voxdiff.cli import train

    run = tmp_path / "run"
    _lock(run)  # a live run holds it
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("the first run's record\n")
    monkeypatch.setattr(sys, "argv", ["train.py", *tiny_demo, f"paths.run_dir={run}"])
    with pytest.raises(SystemExit) as exit_:
        train.main()
    assert exit_.value.code == 2 and "is in use by another run" in capsys.readouterr().err
    assert (run / ".hydra" / "config.yaml").read_text() == "the first run's record\n"


def test_paths_output_dir_on_the_command_line_is_refused_with_paths_run_dir_as_the_fix(tiny_demo, tmp_path,
                                                                                       monkeypatch, capsys):
    """Through the real entry point: paths.output_dir=X would split the run (checkpoints in X; Hydra's config, log
    and the lock in paths.run_dir). Refused before Hydra writes anything, naming the key, the value and the fix."""
    from voxdiff.cli import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", *tiny_demo, f"paths.output_dir={tmp_path / 'x'}"])
    with pytest.raises(SystemExit) as exit_:
        train.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert f"paths.output_dir={tmp_path / 'x'}" in err and f"use paths.run_dir={tmp_path / 'x'} instead" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "logs").exists()  # nothing written, anywhere


def test_the_temporary_file_of_a_checkpoint_write_killed_by_sigkill_is_removed(tmp_path):
    """The real writer (atomic_write), killed with SIGKILL mid-write, leaves its temp file; the next run removes it."""
    code = ("import os, sys; from voxdiff.files import atomic_write; "
            "atomic_write(sys.argv[1], lambda f: (f.write(b'partial'), f.flush(), os.kill(os.getpid(), 9)))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "checkpoints" / "last.ckpt")])
    assert proc.returncode == -9
    left = list((tmp_path / "checkpoints").glob(".last.ckpt.*.tmp"))
    assert len(left) == 1 and not (tmp_path / "checkpoints" / "last.ckpt").exists()
    notes = claim(tmp_path, "auto")
    release(tmp_path)
    assert not left[0].exists() and "removed 1 temporary file(s) of interrupted checkpoint writes" in notes[-1]
