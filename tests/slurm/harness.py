"""A real single-node Slurm (Debian's slurmctld/slurmd 22.05) started by the tests, on this machine.

Everything lives under one temporary folder (``SLURM_CONF`` points at its slurm.conf; nothing is written to /etc).
Authentication is ``auth/none`` so no munged is needed. The node advertises two fake GPUs (character devices made
with ``mknod``, GRES ``gpu``), so job scripts that ask for ``--gres=gpu:1`` are accepted and see
``CUDA_VISIBLE_DEVICES``. ``SlurmdParameters=config_overrides`` lets the node claim the CPUs and memory that the
job scripts ask for. The daemons are stopped by the PIDs this harness started, pass or fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SLURM_PACKAGES = ["slurmctld", "slurmd", "slurm-client"]
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED"}


def ensure_installed() -> None:
    """Install Debian's Slurm packages if they are missing (the test suite sets itself up; needs root + apt)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "scontrol")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("Slurm is not installed and cannot be installed here (needs root and apt-get): "
                           f"apt-get install {' '.join(SLURM_PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *SLURM_PACKAGES], check=True,
                   env=env, capture_output=True)


@dataclass
class SlurmCluster:
    root: Path
    cpus: int = 16
    memory_mb: int = 128000
    gpus: int = 2
    port: int = 16817  # slurmctld's; slurmd takes the next one (another cluster can run beside on other ports)
    first_job_id: int = 1  # another start (job logs are named by job id and appended to)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        for d in ("state", "spool", "log", "dev"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        devices = []
        for i in range(self.gpus):
            dev = self.root / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o600 | 0o020000, os.makedev(195, i))  # a character device, as a GPU is
            devices.append(dev)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=voxdiff-test
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SlurmdParameters=config_overrides
MailProg=/bin/true
ReturnToService=2
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldPort={self.port}
SlurmdPort={self.port + 1}
GresTypes=gpu
MinJobAge=600
FirstJobId={self.first_job_id}
KillWait=5
NodeName=localhost CPUs={self.cpus} RealMemory={self.memory_mb} Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=gpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        (self.root / "gres.conf").write_text(
            "AutoDetect=off\n" + "".join(f"NodeName=localhost Name=gpu File={d}\n" for d in devices)
        )

    def start(self, timeout: float = 30.0) -> None:
        self.write_config()
        log = open(self.root / "log" / "daemons.out", "ab")
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=self.env, stdout=log, stderr=log))
        time.sleep(0.5)
        self.procs.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost"], env=self.env, stdout=log,
                                           stderr=log))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if out in ("idle", "mixed", "allocated"):
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.args}); see {self.root / 'log'}")
            time.sleep(0.3)
        raise TimeoutError(f"the Slurm node did not become idle in {timeout} s; see {self.root / 'log'}")

    def stop(self) -> None:
        try:
            self.run("scancel", "--full", "-u", "root", check=False, timeout=10)
        except Exception:
            pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def run(self, *cmd: str, check: bool = True, timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              check=check, timeout=timeout, **kw)

    def sbatch(self, script: str | Path, *args: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        out = self.run("sbatch", "--parsable", *args, str(script), cwd=cwd, env=env or {}).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout.strip()
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields[key] = value
        return fields

    def wait(self, job_id: int, states: set[str] = TERMINAL_STATES, timeout: float = 300.0,
             poll: float = 0.5) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id), check=False)
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s "
                                   f"(reason {info.get('Reason')})")
            time.sleep(poll)


@contextmanager
def running_cluster(root: Path, **kwargs) -> Iterator[SlurmCluster]:
    """A started cluster (Slurm installed first if missing), stopped by PID when the block ends, pass or fail."""
    ensure_installed()
    cluster = SlurmCluster(root, **kwargs)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
