"""``tests/apt_packages.py``: the suite's own installs of Debian packages, one at a time across its processes.

A fake ``apt-get`` first on ``PATH`` records its calls and, on ``install``, creates the binary after a second; two
processes that both find the binary missing must not run it at the same time (dpkg's lock made one fail with exit
100 on a fresh machine, session 25), and the one that waited must find the binary and not install again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import apt_packages

FAKE_APT = """#!/bin/sh
echo "start $$ $*" >> {log}
case "$*" in
  *fail*) echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2; exit 100;;
  *install*) sleep 1; printf '#!/bin/sh\\n' > {bin}/fakebin; chmod +x {bin}/fakebin;;
esac
echo "end $$ $*" >> {log}
"""


@pytest.fixture
def fake_apt(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "apt.log"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text(FAKE_APT.format(log=log, bin=bin_dir))
    apt.chmod(0o755)
    return bin_dir, log


def test_two_processes_install_one_at_a_time_and_the_second_finds_it_installed(tmp_path, fake_apt):
    bin_dir, log = fake_apt
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import apt_packages
        apt_packages.LOCK = Path({str(tmp_path / "apt.lock")!r})
        apt_packages.ensure(["fakepkg"], ["fakebin"])
        """)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=60) == 0, p.stderr.read()
    calls = log.read_text().splitlines()
    assert [c.split()[0] + " " + c.split()[-1] for c in calls] == [
        "start -qq", "end -qq", "start fakepkg", "end fakepkg"], calls  # update, then install, by one process
    assert len({c.split()[1] for c in calls}) == 2  # two apt-get calls in all, each its own shell
    assert (bin_dir / "fakebin").exists()


def test_a_failed_apt_get_says_which_command_and_why(tmp_path, fake_apt, monkeypatch):
    bin_dir, _ = fake_apt
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(apt_packages, "LOCK", tmp_path / "apt.lock")
    with pytest.raises(RuntimeError, match=r"apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "
                                           r"fail-pkg exited 100: E: Could not get lock"):
        apt_packages.ensure(["fail-pkg"], ["fakebin"])
