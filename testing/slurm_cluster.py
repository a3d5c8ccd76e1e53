"""A real Slurm cluster on one machine, for tests: munge, slurmctld and one slurmd per "node".

    with SlurmCluster(nodes=2) as cluster:
        code, out = cluster.srun(["-N", "2", "-n", "2", "--mpi=pmi2", "hostname"])
        job = cluster.sbatch("#!/bin/sh\\nsrun hostname\\n", ["-N", "2"])
        info = cluster.wait(job, timeout=120)  # JobInfo(state, exit_code, restarts, ...)
        print(open(cluster.output(job)).read())

Debian's ``slurm-wlm`` and ``munge`` packages, started for real (no mock):

- ``munged`` with a fresh key and its own socket (``AuthInfo=socket=...``),
  shared by every daemon and client (a Unix socket crosses network namespaces);
- ``slurmctld`` on the launching node: the root namespace, at the bridge
  address of ``testing/netns_cluster.py``'s ``NetnsCluster``;
- one ``slurmd -N NODE`` per emulated host, inside that host's network, UTS
  (hostname == node name) and, with ``private_dirs``, mount namespace (its
  node-local directories, as NetnsCluster's ``private_dirs``); each with its
  own spool directory, pid file and log (``%n`` in slurm.conf). Jobs' tasks
  (and batch scripts, which run on the job's first node) inherit all of it.

The configuration (``slurm_conf()``): ``proctrack/linuxproc``, ``task/none``,
``select/cons_tres`` with ``CR_Core``, ``CPUs`` = the machine's count (or
``cpus``, with ``SlurmdParameters=config_overrides``), one partition
``debug`` with ``OverSubscribe=YES``, ``KillWait=5`` (SIGKILL 5 s after the
SIGTERM of a cancel or time limit), ``JobRequeue=1``, ``MinJobAge=600`` (a
finished job stays visible to ``scontrol`` for ``wait``), ``cred_expire=15`` in
``AuthInfo`` (a requeued job may start again 16 s after the requeue, not
Slurm's default 121 s: Slurm holds it while its node still refuses the old
job credential; an earlier start there fails with "Job credential revoked"),
``sched_interval=2`` (the scheduler's pass over pending jobs, which starts a
job whose hold is over: 60 s by default),
no accounting
(``sacct`` has nothing). ``config`` adds or overrides lines (e.g.
``["RequeueExit=42"]``). ``MpiDefault=none``: say ``--mpi=pmi2``.

The API, for tests (all client commands get ``env()``):

- ``env()``: ``SLURM_CONF`` for any Slurm client you run yourself
  (``salloc``, ``squeue``; a batch script's ``srun`` inherits it), and
  ``HYDRA_IFACE=eth0``: MPICH's ``mpiexec`` inside an allocation starts its
  proxies with srun, and they connect back to it by its hostname, which no
  node can resolve here; with the interface named, by its address (on a
  node: the node's ``eth0``; in the root namespace: the machine's ``eth0``,
  reached through the bridge);
- ``srun(args, env=None, silence=...) -> (exit status, output)`` and
  ``run(argv, ...)`` for any other client command (``salloc ...``), killed
  once silent for ``silence`` seconds (testing/launch.py's ``run_launcher``);
- ``sbatch(script, args=(), env=None, script_args=()) -> job id``: ``script``
  is the script's text, ``script_args`` its arguments;
  its output goes to ``output(job_id)`` unless ``args`` has ``-o``. Works with
  ``--requeue``, ``--signal=B:USR1@N``, ``--time``, ``--no-kill``;
- ``wait(job_id, timeout) -> JobInfo``: waits until the job is over
  (COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, PREEMPTED, OUT_OF_MEMORY)
  and returns its ``state``, ``exit_code``, ``signal``, ``restarts`` (times
  requeued) and all of ``scontrol show job``'s fields (``fields``);
  ``job(job_id)`` returns that JobInfo at once, whatever the state;
- ``wait_running(job_id, timeout)``: until the job is RUNNING;
- ``scancel(job_id, signal=None, batch=False)``: ``signal`` e.g. "TERM",
  "USR1"; ``batch``: only to the batch script's shell (``--batch``);
- ``requeue(job_id)``: ``scontrol requeue``;
- ``nodes``, ``addresses``, ``netns`` (the NetnsCluster, None on one node),
  ``mpi_env()`` (UCX over TCP between namespaces), ``private_copy(node, path)``;
- ``for_tests()``: what the session fixture ``slurm`` (tests/conftest.py)
  starts: 2 nodes with a node-local directory ``node_local`` (each node its
  own), else 1 node (``multi_node_skip`` then says why), else the reason.

Where namespaces cannot be made (not root, no iproute2): ``nodes=1`` runs one
slurmd in the root namespace (127.0.0.1); asking for more raises
``SlurmUnavailable`` with the reason. Without the packages: the same, naming
them. Needs root (slurmd and munged run as root, ``SlurmUser=root``).

Names carry the creating process id; leftovers of a killed run (daemons,
namespaces, files) are removed by the next run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shlex
import shutil
import signal as signals
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

from testing import netns_cluster
from testing.launch import DEFAULT_SILENCE, run_launcher

_PREFIX = "mpislurm"
_DAEMONS = ("munged", "slurmctld", "slurmd")
_OVER = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")
PACKAGES = "apt-get install slurm-wlm munge"
# Seconds a job credential lives (AuthInfo cred_expire, default 120): also how
# long Slurm holds a requeued job before it may start again.
CRED_EXPIRE = 15


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be started here (packages, root, namespaces); the message says why."""


@dataclasses.dataclass
class JobInfo:
    job_id: str
    state: str  # e.g. COMPLETED, FAILED, CANCELLED, TIMEOUT, PENDING, RUNNING
    exit_code: int  # of the batch script (0 if killed by a signal)
    signal: int  # that killed it, else 0
    restarts: int  # times requeued
    fields: dict[str, str]


def unavailable_reason(nodes: int = 1) -> str | None:
    """Why a cluster of ``nodes`` cannot be started here, or None."""
    missing = [t for t in ("munged", "slurmctld", "slurmd", "srun") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed ({PACKAGES})"
    if os.geteuid() != 0:
        return "the Slurm daemons run as root here"
    if nodes > 1:
        reason = netns_cluster.unavailable_reason()
        if reason:
            return f"{nodes} nodes need network namespaces: {reason}"
    return None


def _in_host_command(argv: list[str]) -> str:
    """The shell command that starts ``argv`` inside a namespace host.

    ``ip netns exec`` mounts a fresh /sys there, without the cgroup file
    systems, and slurmd does not start without them (even with
    proctrack/linuxproc and task/none): it checks cgroup v1's
    ``name=systemd`` hierarchy (this machine's layout; a lone cgroup2 mount
    fails as "hybrid mode"). Mounted in the host's mount namespace, so
    invisible outside.
    """
    cgroups = (
        "mount -t tmpfs cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd"
        " && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd"
    )
    return f"sh -c {shlex.quote(f'{cgroups} && exec {shlex.join(argv)}')}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _kill_daemons(workdir: str) -> None:
    """SIGKILLs the daemons whose pid files are in ``workdir`` (if they are still ours)."""
    for path in glob.glob(os.path.join(workdir, "*.pid")):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                pid = int(f.read().split()[0])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = os.path.basename(f.read().split(b"\0")[0]).decode()
            if command in _DAEMONS:
                os.kill(pid, signals.SIGKILL)


def remove_leftovers() -> None:
    """Daemons and files of clusters whose creating process is gone."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_PREFIX}*-*")):
        m = re.match(rf"^{_PREFIX}(\d+)-", os.path.basename(path))
        if m and not _pid_alive(int(m.group(1))):
            _kill_daemons(path)
            shutil.rmtree(path, ignore_errors=True)
    netns_cluster.remove_leftovers()


def for_tests() -> tuple[SlurmCluster | None, str]:
    """An entered cluster of 2 nodes, else of 1; or (None, why not)."""
    reason = unavailable_reason(1)
    if reason:
        return None, f"no Slurm here: {reason}"
    local = os.path.join(tempfile.gettempdir(), f"{_PREFIX}{os.getpid()}-node-local")
    why_one = unavailable_reason(2)
    if why_one is None:
        try:
            return SlurmCluster(2, private_dirs=[local]).__enter__(), ""
        except SlurmUnavailable as e:
            why_one = str(e)
    try:
        cluster = SlurmCluster(1).__enter__()
    except SlurmUnavailable as e:
        return None, f"Slurm did not start: {e}"
    cluster.multi_node_skip = f"one Slurm node only: {why_one}"
    return cluster, ""


class SlurmCluster:
    """munged + slurmctld + ``nodes`` slurmds; a context manager (see the module docstring)."""

    def __init__(
        self,
        nodes: int = 2,
        cpus: int | None = None,
        private_dirs: Sequence[str] = (),
        config: Sequence[str] = (),
    ):
        reason = unavailable_reason(nodes)
        if reason:
            raise SlurmUnavailable(reason)
        self.cpus = cpus or os.cpu_count() or 1
        self.extra_config = list(config)
        self.netns: netns_cluster.NetnsCluster | None = None
        if nodes > 1:
            self.netns = netns_cluster.NetnsCluster(nodes, private_dirs=private_dirs)
        elif private_dirs:
            raise SlurmUnavailable("private_dirs need network namespaces (nodes >= 2)")
        self.n_nodes = nodes
        self.node_local = self.netns.private_dirs[0] if self.netns and private_dirs else None
        self.multi_node_skip = "" if nodes > 1 else "a cluster of one node"
        self.workdir = ""
        self._procs: list[subprocess.Popen] = []
        self._names: list[str] = []

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        remove_leftovers()
        try:
            if self.netns is not None:
                try:
                    self.netns.__enter__()
                except netns_cluster.NetnsUnavailable as e:
                    raise SlurmUnavailable(f"cannot create network namespaces: {e}") from e
                self.nodes = list(self.netns.hosts)
                self.addresses = list(self.netns.addresses)
                self.controller_address = self.netns.launcher_address
            else:
                self.nodes = [f"{_PREFIX}{os.getpid()}n0"]
                self.addresses = ["127.0.0.1"]
                self.controller_address = "127.0.0.1"
            self.workdir = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Kills every daemon and job, removes namespaces and files. Safe to repeat."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs, self._names = [], []
        if self.workdir:
            _kill_daemons(self.workdir)
        if self.netns is not None:
            self.netns.close()  # also every job's process inside the namespaces
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""
        if self.node_local:  # the mount point (the copies were in the netns workdir)
            shutil.rmtree(self.node_local, ignore_errors=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def _start(self) -> None:
        os.makedirs(self._path("state"))
        os.makedirs(self._path("jobs"))
        key = self._path("munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = self._path("munge.socket")
        self._daemon(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self._path('munged.pid')}",
                f"--log-file={self._path('munged.log')}",
                f"--seed-file={self._path('munged.seed')}",
            ],
        )
        self._wait_for(lambda: os.path.exists(self.munge_socket), "munged", "munged.log")
        self.conf = self._path("slurm.conf")
        with open(self.conf, "w") as f:
            f.write(self.slurm_conf())
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", self.conf])
        for node in self.nodes:
            os.makedirs(self._path(f"spool-{node}"))
            argv = ["slurmd", "-D", "-N", node, "-f", self.conf]
            if self.netns is not None:  # inside the host: its address, hostname, dirs
                argv = [self.netns.agent, node, _in_host_command(argv)]
            self._daemon(f"slurmd-{node}", argv)
        self._wait_for(self._all_idle, "the nodes to be idle", "slurmctld.log")

    def _daemon(self, name: str, argv: list[str]) -> None:
        with open(self._path(f"{name}.out"), "wb") as log:
            self._names.append(name)
            self._procs.append(
                subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def _wait_for(self, ready, what: str, log: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in zip(self._names, self._procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                log = f"{dead[0]}.out" if dead else log
                raise SlurmUnavailable(
                    f"waiting for {what}: "
                    + (f"{dead[0]} exited" if dead else f"not within {timeout} s")
                    + f"; end of {log}:\n{self._tail(log)}"
                )
            time.sleep(0.2)

    def _tail(self, name: str) -> str:
        try:
            with open(self._path(name), errors="replace") as f:
                return f.read()[-3000:]
        except OSError as e:
            return str(e)

    def _all_idle(self) -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"],
            env={**os.environ, **self.env()},
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def slurm_conf(self) -> str:
        """The configuration file's text."""
        lines = [
            "ClusterName=mpistrategy",
            f"SlurmctldHost={socket.gethostname()}({self.controller_address})",
            f"SlurmctldPort={_free_port()}",
            "SlurmdPort=6818" if self.netns is not None else f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}",
            f"StateSaveLocation={self._path('state')}",
            f"SlurmdSpoolDir={self._path('spool-%n')}",
            f"SlurmctldPidFile={self._path('slurmctld.pid')}",
            f"SlurmdPidFile={self._path('slurmd-%n.pid')}",
            f"SlurmctldLogFile={self._path('slurmctld.log')}",
            f"SlurmdLogFile={self._path('slurmd-%n.log')}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "KillWait=5",
            # A requeued job becomes eligible with time, which is no scheduling
            # event: the scheduler's periodic pass (default every 60 s) starts it.
            "SchedulerParameters=sched_interval=2",
            "JobRequeue=1",
            "MinJobAge=600",
            "InactiveLimit=0",
            "MailProg=/bin/true",
        ]
        lines += [
            f"NodeName={n} NodeAddr={a} CPUs={self.cpus} Sockets=1 CoresPerSocket={self.cpus} "
            "ThreadsPerCore=1 State=UNKNOWN"
            for n, a in zip(self.nodes, self.addresses)
        ]
        lines.append("PartitionName=debug Nodes=ALL Default=YES OverSubscribe=YES MaxTime=INFINITE")
        # A later line of the same key wins in slurm.conf.
        return "\n".join(lines + self.extra_config) + "\n"

    # -- clients ---------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The environment a Slurm client needs (on top of os.environ)."""
        hydra = {"HYDRA_IFACE": self.netns.iface} if self.netns is not None else {}
        return {"SLURM_CONF": self.conf, **hydra}

    def mpi_env(self) -> dict[str, str]:
        """UCX over TCP between the nodes (MPICH's UCX would use shared memory across them)."""
        return self.netns.mpi_env() if self.netns is not None else {}

    def private_copy(self, node: str, path: str) -> str:
        assert self.netns is not None, "private_dirs need nodes >= 2"
        return self.netns.private_copy(node, path)

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        silence: float = DEFAULT_SILENCE,
        cwd: str | None = None,
    ) -> tuple[int, str]:
        """Runs a client command (srun, salloc, ...); returns (exit status, output).

        If it is killed (silent for ``silence`` s), the jobs it started are
        cancelled: a killed srun or salloc leaves its job running.
        """
        before = set(self._job_ids())
        try:
            return run_launcher(argv, silence, {**self.env(), **(env or {})}, cwd)
        except AssertionError:
            for job_id in set(self._job_ids()) - before:
                self.scancel(job_id)
            raise

    def _job_ids(self) -> list[str]:
        return self._client("squeue", "-h", "-o", "%i").split()

    def srun(self, args: Sequence[str], **options) -> tuple[int, str]:
        return self.run(["srun", *args], **options)

    def _client(self, *argv: str, env: Mapping[str, str] | None = None) -> str:
        """Runs a short client command; returns its output, raises if it fails."""
        proc = subprocess.run(
            argv,
            env={**os.environ, **self.env(), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stdout}")
        return proc.stdout

    def output(self, job_id: str) -> str:
        """Where ``sbatch`` sent the job's output (when ``args`` had no ``-o``)."""
        return self._path(f"jobs/{job_id}.out")

    def sbatch(
        self,
        script: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        script_args: Sequence[str] = (),
    ) -> str:
        """Submits the batch script ``script`` (its text) with sbatch's options
        ``args`` and the script's own arguments ``script_args``; returns the job id."""
        path = self._path(f"jobs/script-{time.monotonic_ns()}.sh")
        with open(path, "w") as f:
            f.write(script)
        out_args = (
            []
            if {"-o", "--output"} & set(args) or any(a.startswith("--output=") for a in args)
            else ["-o", self._path("jobs/%j.out")]
        )
        out = self._client("sbatch", "--parsable", *out_args, *args, path, *script_args, env=env)
        return out.strip().splitlines()[-1].split(";")[0]

    def job(self, job_id: str) -> JobInfo:
        out = self._client("scontrol", "show", "job", "-o", str(job_id))
        fields = dict(re.findall(r"(\w[\w:/]*)=(\S*)", out))
        code, _, sig = fields.get("ExitCode", "0:0").partition(":")
        return JobInfo(
            str(job_id),
            fields.get("JobState", "?"),
            int(code),
            int(sig or 0),
            int(fields.get("Restarts", "0")),
            fields,
        )

    def wait(self, job_id: str, timeout: float = 300, until=_OVER) -> JobInfo:
        """Waits until the job's state is one of ``until`` (default: over)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.state in until:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} still {info.state} after {timeout} s; output so far:\n"
                    + self._tail(f"jobs/{job_id}.out")
                )
            time.sleep(0.25)

    def wait_running(self, job_id: str, timeout: float = 120) -> JobInfo:
        return self.wait(job_id, timeout, until=("RUNNING", *_OVER))

    def scancel(self, job_id: str, signal: str | None = None, batch: bool = False) -> None:
        self._client(
            "scancel", *([f"--signal={signal}"] if signal else []), *(["--batch"] * batch), job_id
        )

    def requeue(self, job_id: str) -> None:
        self._client("scontrol", "requeue", job_id)
