"""A real Slurm (Debian's slurmctld/slurmd 22.05) started by the tests, on this machine: one node, or several.

Everything lives under one temporary folder (``SLURM_CONF`` points at its slurm.conf; nothing is written to /etc).
Authentication is ``auth/none`` so no munged is needed. Each node advertises fake GPUs (character devices made
with ``mknod``, GRES ``gpu``), so job scripts that ask for ``--gres=gpu:1`` are accepted and see
``CUDA_VISIBLE_DEVICES``. ``SlurmdParameters=config_overrides`` lets a node claim the CPUs and memory that the
job scripts ask for. The daemons are stopped by the PIDs this harness started, pass or fail.

``SlurmCluster(nodes=1)`` is one ``slurmd`` named ``localhost`` beside ``slurmctld``. ``nodes=N > 1`` gives each
``slurmd`` a host of its own: a network namespace (``ip netns``) with its own address on a bridge that also holds
``slurmctld``'s address, its own hostname (UTS namespace) and its own ``/etc/hosts`` (bind-mounted in a mount
namespace) that names every node, so that ``srun``, Lightning's ``SLURMEnvironment`` and gloo resolve and reach
``node1``, ``node2``, ... as on a cluster. The filesystem is shared, as a cluster's is. All addresses are in a
private range that only these namespaces use; the bridge and namespaces are removed by ``stop``.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from apt_packages import ensure  # tests/ is on sys.path (its conftest.py)

REPO = Path(__file__).resolve().parents[2]
EXP11 = REPO / "slurm" / "exp11.slurm"  # the rendered job script the tests submit, unchanged
SLURM_PACKAGES = ["slurmctld", "slurmd", "slurm-client"]
#: the lock a test process holds while its cluster runs (:func:`running_cluster`)
LOCK = Path(tempfile.gettempdir()) / "voxdiff-tests-slurm.lock"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED"}


def ensure_installed() -> None:
    """Install Debian's Slurm packages if they are missing (the test suite sets itself up; needs root + apt; one
    install at a time across the suite's processes: ``apt_packages.ensure``)."""
    ensure(SLURM_PACKAGES, ("slurmctld", "slurmd", "sbatch", "scontrol"))


def _kill_job_steps(job_ids: set[int]) -> None:
    """SIGKILL every ``slurmstepd: [<job>.<step>]`` of these jobs and everything below it (the job script, srun,
    the tasks). Job ids are unique per test cluster (``first_job_id``), so no other cluster's job is touched."""
    parents: dict[int, int] = {}
    steps = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        if cmdline.startswith("slurmstepd: [") and int(cmdline[13:].split(".")[0].split("]")[0]) in job_ids:
            steps.append(int(proc.name))
    doomed = set(steps)
    while True:
        more = {pid for pid, ppid in parents.items() if ppid in doomed} - doomed
        if not more:
            break
        doomed |= more
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class SlurmCluster:
    root: Path
    cpus: int = 16
    memory_mb: int = 128000
    gpus: int = 2
    nodes: int = 1
    port: int = 16817  # slurmctld's; slurmd's is the next one
    subnet: str = "10.213.0"  # multi-node only: slurmctld at .1, node i at .(10 + i)
    procs: list[subprocess.Popen] = field(default_factory=list)
    _netns: list[str] = field(default_factory=list)
    _jobs: set[int] = field(default_factory=set)

    @property
    def node_names(self) -> list[str]:
        return ["localhost"] if self.nodes == 1 else [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def bridge(self) -> str:
        return f"vxbr{self.port}"

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def first_job_id(self) -> int:
        """Job ids that no earlier test cluster on this checkout used: a job's log, slurm/logs/%x-%j.out, is opened
        in append mode (the requeued half writes after the first), so a reused id would read an old run's lines."""
        return 1_000_000 + int(time.time() * 10) % 60_000_000

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
        if self.nodes == 1:
            ctl, node_lines = "localhost", (f"NodeName=localhost CPUs={self.cpus} RealMemory={self.memory_mb} "
                                            f"Gres=gpu:{self.gpus} State=UNKNOWN\n")
        else:
            ctl = f"localhost({self.subnet}.1)"
            node_lines = "".join(
                f"NodeName={n} NodeAddr={self.subnet}.{10 + i} NodeHostname={n} CPUs={self.cpus} "
                f"RealMemory={self.memory_mb} Gres=gpu:{self.gpus} State=UNKNOWN\n"
                for i, n in enumerate(self.node_names, 1))
        self.conf.write_text(f"""\
ClusterName=voxdiff-test
SlurmctldHost={ctl}
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
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldPort={self.port}
SlurmdPort={self.port + 1}
GresTypes=gpu
MinJobAge=600
FirstJobId={self.first_job_id}
KillWait=5
{node_lines}PartitionName=gpu Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
""")
        (self.root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={n} Name=gpu File={d}\n" for n in self.node_names for d in devices))
        for n in self.node_names:
            (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)
        if self.nodes > 1:
            (self.root / "hosts").write_text(f"127.0.0.1 localhost\n{self.subnet}.1 slurmctld\n" + "".join(
                f"{self.subnet}.{10 + i} {n}\n" for i, n in enumerate(self.node_names, 1)))

    def _network(self) -> None:
        """A bridge holding slurmctld's address and one network namespace per node, joined to it by a veth pair."""
        ip = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True, text=True)  # noqa: E731
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)  # left over by a killed run
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.node_names, 1):
            ns, host_end = f"vx{self.port}-{name}", f"vx{self.port}h{i}"
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            ip("netns", "add", ns)
            self._netns.append(ns)
            for attempt in range(20):  # a namespace deleted just before frees its veth pair asynchronously
                subprocess.run(["ip", "link", "del", host_end], capture_output=True)
                if subprocess.run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns],
                                  capture_output=True).returncode == 0:
                    break
                time.sleep(0.25)
            else:
                ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)  # raises, says why
            ip("link", "set", host_end, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.subnet}.{10 + i}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def _slurmd(self, name: str) -> list[str]:
        if self.nodes == 1:
            return ["slurmd", "-D", "-N", name]
        # its own host: network namespace, hostname, /etc/hosts naming every node
        script = (f"hostname {name} && mount --bind {self.root / 'hosts'} /etc/hosts && "
                  f"exec slurmd -D -N {name}")
        # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup filesystem slurmd needs
        return ["nsenter", f"--net=/run/netns/vx{self.port}-{name}", "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c", script]

    def start(self, timeout: float = 30.0) -> None:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        self.write_config()
        if self.nodes > 1:
            self._network()
        log = open(self.root / "log" / "daemons.out", "ab")
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=self.env, stdout=log, stderr=log))
        time.sleep(0.5)
        for name in self.node_names:
            self.procs.append(subprocess.Popen(self._slurmd(name), env=self.env, stdout=log, stderr=log))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
            if len(states) == self.nodes and all(s in ("idle", "mixed", "allocated") for s in states):
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
        _kill_job_steps(self._jobs)  # a step whose slurmd died before it (a failed test) would run on
        for ns in self._netns:  # removing a namespace removes its veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._netns.clear()
        if self.nodes > 1:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              check=check, timeout=timeout, **kw)

    def sbatch(self, script: str | Path, *args: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        out = self.run("sbatch", "--parsable", *args, str(script), cwd=cwd, env=env or {}).stdout
        job_id = int(out.strip().split(";")[0])
        self._jobs.add(job_id)
        return job_id

    def job(self, job_id: int) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout.strip()
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields[key] = value
        return fields

    def release_requeued(self, job_id: int) -> None:
        """Start a requeued, pending job now instead of after Slurm's hold (BeginTime, ~2 minutes), as an admin would.

        The hold is there for a reason this must respect: the requeue revoked the job's credential on the node at a
        time of whole seconds, and slurmd refuses a new credential created in that same second ("Killing
        non-startable batch job: Job credential revoked", and the job ends FAILED). The revocation happened before
        the job became pending, so once the clock is in a later second than now, a release is safe."""
        assert self.job(job_id)["JobState"] == "PENDING", self.job(job_id)
        time.sleep(max(0.0, int(time.time()) + 1.05 - time.time()))
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def wait_for_file(self, job_id: int, path: Path, timeout: float = 300.0, log=lambda: "") -> None:
        """Wait until the job creates ``path`` (e.g. HoldAtStep's ``.held`` file); fail at once if the job ended."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            state = self.job(job_id).get("JobState")
            if state not in ("PENDING", "RUNNING", "CONFIGURING") or time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} ({state}) did not create {path} in time:\n{log()}")
            time.sleep(0.2)

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
    """A started cluster (Slurm installed first if missing), stopped by PID when the block ends, pass or fail.

    One cluster at a time across the suite's processes (an exclusive ``flock`` on :data:`LOCK`, held while it
    runs): two started in the same tenth of a second take the same job ids (:attr:`SlurmCluster.first_job_id`),
    so their jobs append to one log (session 35: both workers' requeue tests failed on it), and two at once share
    the two cores that each job's training needs. Within one ``make test`` the ``xdist_group`` the suite's conftest
    gives these tests keeps them on one worker, one after another (under pytest 9.2 it did not: session 35 saw six
    tests of one group run three on each worker, each waiting here for the other's cluster); the lock keeps apart
    the clusters of two pytest runs at once."""
    ensure_installed()
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        cluster = SlurmCluster(root, **kwargs)
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()


# ------------------------------------------------------------------------------------- the exp11 job of the tests
def submit_exp11(cluster: SlurmCluster, run_root: Path, overrides: str, *sbatch_args: str) -> int:
    """``sbatch [ARGS] slurm/exp11.slurm`` from the repository, with CPU-sized ``overrides`` (VOXDIFF_OVERRIDES),
    this test's Python environment and ``run_root`` for its run directories."""
    import sys

    env = {"VOXDIFF_RUN_ROOT": str(run_root), "VOXDIFF_VENV": str(Path(sys.executable).parents[1]),
           "VOXDIFF_OVERRIDES": overrides, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return cluster.sbatch(EXP11, *sbatch_args, cwd=REPO, env=env)


def job_log(job_id: int) -> str:
    """The job's output (``slurm/logs/voxdiff-exp11-<id>.out``, both halves of a requeued job), or ''. A requeue
    kills the job mid-write, which can cut a progress bar's multi-byte character: undecodable bytes are replaced."""
    path = REPO / "slurm" / "logs" / f"voxdiff-exp11-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def exp11_run_dir(run_root: Path, job_id: int) -> Path:
    return run_root / "exp11" / f"job-{job_id}"


def checkpoint_step(ckpt: Path) -> int:
    import torch

    return int(torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"])
