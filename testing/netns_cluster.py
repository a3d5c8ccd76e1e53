"""Several "hosts" on one machine: Linux network namespaces joined by a bridge.

    with NetnsCluster(3) as cluster:
        argv = ["mpiexec", "-n", "3", *cluster.mpiexec_args(), "python", "train.py"]
        subprocess.run(argv, env={**os.environ, **cluster.mpi_env()})

Each host is a network namespace with its own interface ``eth0`` and address
(10.213.K.10+i/24) on a bridge in the root namespace, whose address
(10.213.K.1) is the launching node. MPICH's hydra ``mpiexec`` runs in the root
namespace and starts its proxies through a generated launcher agent, used in
place of ``ssh`` (``-launcher ssh -launcher-exec AGENT``): the agent runs the
proxy command inside the host's namespace, with its own hostname (UTS
namespace). The proxies connect back to ``mpiexec`` at the bridge address
(``-localhost``). Ranks on different hosts are on different MPI nodes and talk
TCP through the veth pairs; ``mpi_env()`` makes MPICH's UCX layer use TCP only,
since by default it reaches across network namespaces through shared memory.

Hosts share the machine's filesystems, unless ``private_dirs`` names paths to
make node-local (like each machine's own ``/tmp``): the agent then also gives
the proxy a mount namespace where each such path is a bind mount of a fresh
per-host directory (``private_copy(host, path)``, on the disk under the
cluster's work directory, so that writes there count in ``/proc/PID/io``'s
``write_bytes``, which a tmpfs leaves at 0). All ranks of a host see the same
contents there, ranks of other hosts their own; the root namespace sees
neither. What a host wrote stays for its later launches and for inspection.

Each host resolves every host's name to its address: ``ip netns exec`` mounts
``/etc/netns/HOST/hosts`` (the machine's /etc/hosts and one line per host)
over /etc/hosts. Without it a host's own name is looked up in DNS, whose
server a namespace cannot reach: 20 s per lookup, which MPICH's ``mpiexec``
makes at start (measured: ``mpiexec -n 1 true`` on a Slurm node took 20 s,
30 s with ``-launcher fork``; 0.2 s with the names in hosts). Any other name
fails at once (an empty ``/etc/netns/HOST/resolv.conf``): TensorFlow's
PreemptionCheckpointHandler looks up Google's metadata server when it is
built, 10 s on a host before.

Needs root and iproute2. Names carry the creating process id, so leftovers of
a killed run never collide with a new one and are removed by the next run.
"""

import contextlib
import errno
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time

_PREFIX = "mpis"
# mpis<pid><letter>: short enough for 15-character interface names.
_NAME = re.compile(rf"^{_PREFIX}(\d+)([a-z])(?:br|v\d|h\d)$")
_SUBNET_BASE = "10.213"
_created = [0]


class NetnsUnavailable(RuntimeError):
    """This machine cannot create the namespaces (not root, no iproute2, a sandbox...)."""


def _run(*argv, check=True):
    # ip / tc return at once; the timeout only turns a wedged one into an error.
    proc = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60
    )
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout)
    return proc.stdout


def unavailable_reason():
    """Why no cluster can be built here, or None if it can be tried."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (ip, tc: iproute2; unshare: util-linux)"
    return None


def netem_available():
    """True if the kernel has the netem qdisc (``tc ... netem delay``)."""
    probe = f"{_PREFIX}{os.getpid()}p"
    try:
        _run("ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "q")
    except subprocess.CalledProcessError:
        return False
    try:
        return (
            subprocess.run(
                ["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"],
                capture_output=True,
                timeout=60,
            ).returncode
            == 0
        )
    finally:
        _run("ip", "link", "del", probe, check=False)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


_ETC_NETNS = "/etc/netns"  # per-namespace /etc files that `ip netns exec` mounts


def remove_leftovers():
    """Removes namespaces and links left by clusters whose process is gone."""
    names = _run("ip", "netns", "list", check=False).split()
    links = re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", "show", check=False), re.M)
    for name in names + links:
        m = _NAME.match(name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        if name in names:
            _kill_netns_processes(name)
            _run("ip", "netns", "del", name, check=False)
            shutil.rmtree(os.path.join(_ETC_NETNS, name), ignore_errors=True)
        else:
            _run("ip", "link", "del", name, check=False)
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_PREFIX}*-*")):
        m = re.match(rf"^{_PREFIX}(\d+)[a-z]-", os.path.basename(path))
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _netns_pids(netns):
    out = _run("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_netns_processes(netns):
    # Deleting a namespace does not end the processes inside it.
    for _ in range(50):
        pids = _netns_pids(netns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _free_subnet():
    used = _run("ip", "-4", "-o", "addr", "show")
    for k in range(1, 255):
        if f" {_SUBNET_BASE}.{k}." not in used:
            return f"{_SUBNET_BASE}.{k}"
    raise NetnsUnavailable(f"no free /24 left in {_SUBNET_BASE}.0.0/16")


class NetnsCluster:
    """``n_hosts`` network-namespace hosts on a bridge; a context manager.

    Attributes:
      hosts: the hosts' names (namespace name == hostname).
      addresses: their IPv4 addresses, in the same order.
      veths: the root-namespace end of each host's veth pair (its traffic
        counters are the host's traffic).
      launcher_address: the bridge address, where mpiexec listens.
      iface: the interface name inside every host (``eth0``).
      private_dirs: the absolute paths each host sees as its own (node-local).
    """

    iface = "eth0"

    def __init__(self, n_hosts, private_dirs=()):
        if not 1 <= n_hosts <= 9:
            raise ValueError(f"n_hosts must be 1..9, got {n_hosts}")
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        self.n_hosts = n_hosts
        self.private_dirs = [os.path.abspath(p) for p in private_dirs]
        _created[0] += 1
        self.tag = f"{_PREFIX}{os.getpid()}{chr(ord('a') + (_created[0] - 1) % 26)}"
        self.bridge = f"{self.tag}br"
        self.hosts = [f"{self.tag}h{i}" for i in range(n_hosts)]
        self.veths = [f"{self.tag}v{i}" for i in range(n_hosts)]
        self.workdir = None
        self.agent = None

    # -- lifecycle -----------------------------------------------------------------
    def __enter__(self):
        remove_leftovers()
        try:
            self._create()
        except BaseException as e:
            self.close()
            if isinstance(e, subprocess.CalledProcessError):
                raise NetnsUnavailable(
                    f"`{' '.join(e.cmd)}` failed: {(e.output or '').strip()}"
                ) from e
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _create(self):
        subnet = _free_subnet()
        self.launcher_address = f"{subnet}.1"
        self.addresses = [f"{subnet}.{10 + i}" for i in range(self.n_hosts)]
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.launcher_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host, veth, address in zip(self.hosts, self.veths, self.addresses):
            _run("ip", "netns", "add", host)
            _run(
                "ip", "link", "add", veth, "type", "veth", "peer", "name", self.iface, "netns", host
            )
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            inside = ("ip", "netns", "exec", host)
            _run(*inside, "ip", "addr", "add", f"{address}/24", "dev", self.iface)
            _run(*inside, "ip", "link", "set", self.iface, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "route", "add", "default", "via", self.launcher_address)
        self._write_hosts_files()
        self.workdir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        for host in self.hosts:
            for path in self.private_dirs:
                os.makedirs(self.private_copy(host, path))
                os.makedirs(path, exist_ok=True)  # the mount point
        self.agent = os.path.join(self.workdir, "netns-agent")
        with open(self.agent, "w") as f:
            f.write(self._agent_script())
        os.chmod(self.agent, 0o755)

    def _write_hosts_files(self):
        """/etc/netns/HOST/hosts: the machine's lines, then every host's name;
        /etc/netns/HOST/resolv.conf: no name server (DNS fails at once)."""
        try:
            with open("/etc/hosts") as f:
                machine = f.read()
        except OSError:
            machine = "127.0.0.1 localhost\n"
        names = "".join(f"{a} {h}\n" for h, a in zip(self.hosts, self.addresses))
        for host in self.hosts:
            os.makedirs(os.path.join(_ETC_NETNS, host), exist_ok=True)
            with open(os.path.join(_ETC_NETNS, host, "hosts"), "w") as f:
                f.write(f"{machine.rstrip()}\n# testing/netns_cluster.py\n{names}")
            with open(os.path.join(_ETC_NETNS, host, "resolv.conf"), "w") as f:
                f.write("# testing/netns_cluster.py: no DNS (the host's own 127.0.0.1)\n")

    def close(self):
        """Kills every process on the hosts and removes all namespaces and links.

        Safe to call several times and after a partial creation.
        """
        for host in self.hosts:
            _kill_netns_processes(host)
            _run("ip", "netns", "del", host, check=False)
            shutil.rmtree(os.path.join(_ETC_NETNS, host), ignore_errors=True)
        for link in [*self.veths, self.bridge]:
            _run("ip", "link", "del", link, check=False)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    # -- launching -----------------------------------------------------------------
    def _agent_script(self):
        cases = "\n".join(f"  {h}|{a}) netns={h} ;;" for h, a in zip(self.hosts, self.addresses))
        # Called by hydra as `AGENT [ssh options] HOST COMMAND...`; like ssh, the
        # words of COMMAND are joined and run by a shell (hydra quotes for that).
        unshare, mounts, mount_args = "--uts", "", ""
        if self.private_dirs:  # $3: the private copies' root; $4...: the paths
            unshare = "--uts --mount --propagation private"
            mounts = "".join(
                f' && mount --bind "$3/$1/{i}" "${{{4 + i}}}"'
                for i in range(len(self.private_dirs))
            )
            mount_args = " " + " ".join(
                shlex.quote(p) for p in [os.path.join(self.workdir, "private"), *self.private_dirs]
            )
        return f"""#!/bin/sh
# Generated by testing/netns_cluster.py: hydra's "ssh" into a network namespace.
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "netns-agent: unknown host '$host'" >&2; exit 255 ;;
esac
exec ip netns exec "$netns" unshare {unshare} -- \\
  sh -c 'hostname "$1"{mounts} && exec sh -c "exec $2"' netns-agent "$netns" "$*"{mount_args}
"""

    def mpiexec_args(self, n_hosts=None, ranks_per_host=1):
        """hydra options that place ``ranks_per_host`` rank slots on each of the
        first ``n_hosts`` hosts (ranks fill a host's slots before the next host's)."""
        hosts = self.hosts[: n_hosts or self.n_hosts]
        if ranks_per_host != 1:
            hosts = [f"{h}:{ranks_per_host}" for h in hosts]
        return [
            "-launcher",
            "ssh",
            "-launcher-exec",
            self.agent,
            "-hosts",
            ",".join(hosts),
            "-localhost",
            self.launcher_address,
        ]

    def private_copy(self, host, path):
        """The directory that ``host`` sees at ``path``, one of ``private_dirs``."""
        index = self.private_dirs.index(os.path.abspath(path))
        return os.path.join(self.workdir, "private", host, str(index))

    def mpi_env(self):
        """Environment for mpiexec so that ranks on different hosts use TCP."""
        return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": self.iface}

    # -- inspecting and disturbing hosts ---------------------------------------------
    def exec_argv(self, host, *argv):
        """``argv`` to run a command inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host, *argv]

    def pids(self, host):
        """Process ids of everything running inside ``host``."""
        return _netns_pids(host)

    def tx_bytes(self):
        """Bytes each host has sent so far (root-side veth counters), by host."""
        return {
            h: int(_read_sysfs(f"/sys/class/net/{v}/statistics/rx_bytes"))
            for h, v in zip(self.hosts, self.veths)
        }

    def shaping_commands(self, rate_mbit=None, delay_ms=None):
        """``tc`` commands that, run inside a host, shape its egress (or clear it).

        ``rate_mbit`` uses a token bucket (tbf, counted on whole Ethernet
        frames); ``delay_ms`` needs the netem qdisc (see ``netem_available``).
        Neither: remove the shaping.
        """
        dev = ["dev", self.iface, "root"]
        if rate_mbit is None and delay_ms is None:
            # The "replace" by a plain fifo always succeeds, with or without a qdisc.
            return [["tc", "qdisc", "replace", *dev, "pfifo", "limit", "1000"]]
        if delay_ms is None:
            # A small bucket (a few frames) so the rate holds on short messages;
            # a deep queue so TCP sees no drops.
            return [
                [
                    "tc",
                    "qdisc",
                    "replace",
                    *dev,
                    "tbf",
                    "rate",
                    f"{rate_mbit}mbit",
                    "burst",
                    "16kb",
                    "limit",
                    "8mb",
                ]
            ]
        netem = [
            "tc",
            "qdisc",
            "replace",
            *dev,
            "netem",
            "delay",
            f"{delay_ms}ms",
            "limit",
            "100000",
        ]
        if rate_mbit is not None:
            netem += ["rate", f"{rate_mbit}mbit"]
        return [netem]


def _read_sysfs(path):
    with open(path) as f:
        return f.read().strip()
