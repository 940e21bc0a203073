"""One table of exit codes (voxdiff.cli.exit_codes): distinct codes, used by every entry point, listed in the
README, and read by slurm/job.sh (whose "preflight refused" no longer collides with the NaN stop's 3)."""

import re
import subprocess
import sys

from voxdiff.cli import cache_latents, evaluate, exit_codes, preflight, sample, train
from voxdiff.cli.exit_codes import TABLE, describe, markdown


def test_codes_are_distinct_and_the_entry_points_use_them():
    codes = [row.code for row in TABLE]
    assert len(codes) == len(set(codes)) and 0 in codes and 1 in codes
    for module in (train, sample, evaluate, cache_latents, preflight):
        for name in ("EXIT_CONFIG", "EXIT_NONFINITE", "EXIT_NO_FIT", "EXIT_DATA", "EXIT_WRITE", "EXIT_TERMINATED",
                     "EXIT_OK"):
            if hasattr(module, name):
                assert getattr(module, name) == getattr(exit_codes, name), (module.__name__, name)
    assert "no signal" in describe(exit_codes.EXIT_DATA) and "not a voxdiff exit code" in describe(137)


def test_the_readme_lists_every_exit_code(repo):
    readme = (repo / "README.md").read_text()
    assert "## Errors and exit codes" in readme
    assert markdown() in readme  # the README's table is the table


def test_job_sh_exits_with_the_tables_codes(repo):
    text = (repo / "slurm" / "job.sh").read_text()
    names = {row.name: row.code for row in TABLE}
    for line in (l.strip() for l in text.splitlines()):
        if re.match(r"exit\b", line):
            literal = re.fullmatch(r"exit (\d+)\s+# (EXIT_\w+).*", line)
            assert line == 'exit "$rc"' or (literal and names[literal.group(2)] == int(literal.group(1))), line
    shell = subprocess.run(["bash", "-c", f'eval "$({sys.executable} -m voxdiff.cli.exit_codes)"; '
                                          'echo "$EXIT_CONFIG $EXIT_NONFINITE $EXIT_NO_FIT $EXIT_TERMINATED"'],
                           capture_output=True, text=True, check=True)
    assert shell.stdout.split() == ["2", "3", "4", "143"]


def test_refusals_turn_bad_input_into_one_line_and_its_code(capsys):
    import pytest

    from voxdiff.cli.exit_codes import EXIT_CONFIG, EXIT_DATA, refusals
    from voxdiff.data.nifti import DataError
    from voxdiff.errors import ConfigError

    with pytest.raises(SystemExit) as stop, refusals():
        raise ConfigError("n", 1, "must be at least 2", "use n=2 or more")
    assert stop.value.code == EXIT_CONFIG
    assert capsys.readouterr().err.strip() == "[voxdiff] config error: n=1: must be at least 2. Fix: use n=2 or more"
    with pytest.raises(SystemExit) as stop, refusals():
        raise DataError("/data/s1/bravo.nii.gz: has NaN voxels")
    assert stop.value.code == EXIT_DATA and "bravo.nii.gz" in capsys.readouterr().err
    from voxdiff.cli.exit_codes import EXIT_WRITE
    from voxdiff.files import CheckpointWriteError

    with pytest.raises(SystemExit) as stop, refusals():
        raise CheckpointWriteError(28, "no space left on /runs/x: the checkpoint needs 2 GB, 1 GB free")
    assert stop.value.code == EXIT_WRITE
    assert capsys.readouterr().err.strip() == ("[voxdiff] write failed: no space left on /runs/x: the checkpoint needs "
                                               "2 GB, 1 GB free")
    with pytest.raises(SystemExit) as stop, refusals():  # a full disk met by a writer that is not voxdiff's
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 123 vs 456")
    assert stop.value.code == EXIT_WRITE and "no space left" in capsys.readouterr().err
    with pytest.raises(KeyError), refusals():  # anything else is a bug: its traceback stays
        raise KeyError("x")
