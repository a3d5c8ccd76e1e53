"""The same program across "hosts": network namespaces joined by TCP (testing/netns_cluster.py).

Launches the real MPICH hydra ``mpiexec`` with ranks on namespace hosts and
checks that (1) training gives the results of a single-host run with as many
ranks, (2) the step time grows with a rate-limited (and, where the kernel has
netem, delayed) link as an alpha-beta cost model predicts, (3) killing
one host's rank ends the whole job promptly, leaving nothing running, and
(4) a save made on every rank lands once on a shared filesystem and once per
host on node-local disks (write_point.py).

Five launches in all (single host at 2 and 3 ranks, 2 and 3 namespace hosts,
and 2 hosts x 2 ranks with a node-local directory); the namespaces are created
once for the module, but (4) has its own. Skipped without root, iproute2,
namespace support, or MPICH's hydra. See docs/multihost.md.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mpi_testing import PROGRAMS
from testing import netns_cluster
from testing.launch import is_open_mpi, run_mpiexec

pytestmark = pytest.mark.single_process

TRAIN_STEPS = 6  # steps compared with the single-host run
RATES_MBIT = (40, 10)  # tbf rate limits of the cost-model test
DELAYS_MS = (5, 20)  # netem delays of the cost-model test (if the kernel has netem)
TIMED_STEPS, WARMUP_STEPS = 6, 2
KILL_DEADLINE_S = 30
# What a rank that does not save may write: autograph's sources on a first call,
# and Keras's temporary directory in /tmp on every .keras save (~8-16 KiB).
FIRST_CALL_BYTES = 64 << 10

# One program for every launch but the saving one: each rank writes its
# losses, weights, host and the collectives it issued (counted by a COMM_WORLD
# wrapper) to --out.
PROGRAM = os.path.join(PROGRAMS, "multihost_training.py")
SAVE_PROGRAM = os.path.join(PROGRAMS, "multihost_saving.py")


# -- fixtures ----------------------------------------------------------------------------------
def _new_cluster(n_hosts, **options):
    """An entered NetnsCluster (the caller closes it), or a skip saying why not."""
    reason = netns_cluster.unavailable_reason()
    if reason is None and is_open_mpi():
        reason = "the namespace launcher agent is written for MPICH's hydra mpiexec"
    if reason:
        pytest.skip(f"multi-host tests skipped: {reason}")
    try:
        return netns_cluster.NetnsCluster(n_hosts, **options).__enter__()
    except netns_cluster.NetnsUnavailable as e:
        pytest.skip(f"multi-host tests skipped: cannot create network namespaces here ({e})")


@pytest.fixture(scope="module")
def cluster():
    hosts = _new_cluster(3)
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def program():
    """The program of every launch but the saving one."""
    return PROGRAM


def _launch(n, program, out_dir, extra_args=(), cluster=None, silence=240, during=None):
    """Runs ``program`` on n ranks (one per namespace host if ``cluster``), returns run info."""
    os.makedirs(out_dir, exist_ok=True)
    argv = [sys.executable, program, "--out", out_dir, "--steps", str(TRAIN_STEPS), *extra_args]
    env = {}
    if cluster is not None:
        argv = cluster.mpiexec_args(n) + argv
        env = cluster.mpi_env()
        sent_before = cluster.tx_bytes()
    watcher, launched = None, threading.Event()
    if during is not None:  # runs while the job does; told when it is over
        watcher = threading.Thread(target=during, args=(launched,), daemon=True)
        watcher.start()
    start = time.monotonic()
    try:
        code, out = run_mpiexec(n, argv, silence=silence, env=env)
    finally:
        launched.set()
    info = {
        "code": code,
        "out": out,
        "ended": time.monotonic(),
        "seconds": time.monotonic() - start,
    }
    if watcher is not None:
        watcher.join(timeout=10)
    if cluster is not None:
        after = cluster.tx_bytes()
        info["sent"] = {h: after[h] - sent_before[h] for h in cluster.hosts[:n]}
    results = []
    for r in range(n):
        path = os.path.join(out_dir, f"result{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
            with np.load(os.path.join(out_dir, f"weights{r}.npz")) as w:
                results[-1]["weights"] = [w[k] for k in sorted(w.files, key=lambda s: int(s[4:]))]
    info["results"] = results
    return info


def _assert_ran(info):
    assert info["code"] == 0, info["out"][-5000:]


@pytest.fixture(scope="module")
def single_host(program, tmp_path_factory):
    """The reference: plain ``mpiexec -n 2`` and ``-n 3`` on this host."""
    base = tmp_path_factory.mktemp("single_host")
    return {n: _launch(n, program, str(base / f"n{n}")) for n in (2, 3)}


def _phases(cluster):
    phases = [("none", {})]
    phases += [(f"rate {r} Mbit/s", {"rate_mbit": r}) for r in RATES_MBIT]
    if netns_cluster.netem_available():
        phases += [(f"delay {d} ms", {"delay_ms": d}) for d in DELAYS_MS]
    phases.append(("none again", {}))  # also leaves the links unshaped
    return [
        {"name": name, "shaping": shaping, "commands": cluster.shaping_commands(**shaping)}
        for name, shaping in phases
    ]


def _timed_two_hosts(cluster, program, out_dir, phases, extra_args=()):
    """2 namespace hosts: the compared training steps, then the timed ``phases``."""
    info = _launch(
        2,
        program,
        out_dir,
        cluster=cluster,
        extra_args=[
            *extra_args,
            "--phases",
            json.dumps(phases),
            "--timed-steps",
            str(TIMED_STEPS),
            "--warmup-steps",
            str(WARMUP_STEPS),
        ],
    )
    info["phase_specs"] = phases
    return info


@pytest.fixture(scope="module")
def two_hosts(cluster, program, tmp_path_factory):
    """2 namespace hosts: the compared training steps, then the timed shaping phases."""
    return _timed_two_hosts(
        cluster, program, str(tmp_path_factory.mktemp("two_hosts")), _phases(cluster)
    )


@pytest.fixture(scope="module")
def two_hosts_float16(cluster, program, tmp_path_factory):
    """2 namespace hosts training with compression="float16", then the 10 Mbit/s phase."""
    phases = [
        p
        for p in _phases(cluster)
        if p["shaping"].get("rate_mbit", 10) == 10 and "delay_ms" not in p["shaping"]
    ]
    return _timed_two_hosts(
        cluster,
        program,
        str(tmp_path_factory.mktemp("two_hosts_float16")),
        phases,
        extra_args=["--compression", "float16"],
    )


@pytest.fixture(scope="module")
def three_hosts(cluster, program, tmp_path_factory):
    """3 namespace hosts: the compared training steps, then training until the
    python of host 1 is killed with SIGKILL."""
    out_dir = str(tmp_path_factory.mktemp("three_hosts"))
    marker = os.path.join(out_dir, "training_until_killed")
    victim = cluster.hosts[1]
    killed = {}

    def kill_host_1_mid_training(job_over):
        while not os.path.exists(marker):
            if job_over.wait(0.1):
                return
        if job_over.wait(1.0):  # let it get well into the training loop
            return
        for pid in cluster.pids(victim):
            if _comm(pid) == os.path.basename(sys.executable) or _comm(pid).startswith("python"):
                subprocess.run(cluster.exec_argv(victim, "kill", "-9", str(pid)), check=False)
                killed.setdefault("pids", []).append(pid)
        killed["at"] = time.monotonic()

    info = _launch(
        3,
        program,
        out_dir,
        cluster=cluster,
        extra_args=["--until-killed"],
        during=kill_host_1_mid_training,
        silence=240,
    )
    info["killed"] = killed
    info["victim"] = victim
    # mpiexec may return while a SIGKILLed rank is still being torn down:
    # give the job's processes a few seconds to disappear.
    deadline = time.monotonic() + 10
    while True:
        left = {h: [f"{pid} {_comm(pid)}" for pid in cluster.pids(h)] for h in cluster.hosts}
        left = {h: pids for h, pids in left.items() if pids}
        left_in_root = [f"{pid} {_cmdline(pid)}" for pid in _all_pids() if out_dir in _cmdline(pid)]
        if (not left and not left_in_root) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    info["all_gone"] = time.monotonic()
    info["left_in_namespaces"], info["left_in_root"] = left, left_in_root
    return info


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _all_pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


# -- 1. same results as on one host ----------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_training_across_hosts_matches_single_host(n, cluster, single_host, request):
    multi = request.getfixturevalue("two_hosts" if n == 2 else "three_hosts")
    if n == 2:
        _assert_ran(multi)
    ref = single_host[n]
    _assert_ran(ref)
    assert len(multi["results"]) == n, multi["out"][-5000:]

    # Really several hosts: one rank per hostname, each alone on its MPI node,
    # and the gradients crossed every host's veth.
    assert [r["host"] for r in multi["results"]] == cluster.hosts[:n]
    assert [r["ranks_on_node"] for r in multi["results"]] == [1] * n
    assert [r["ranks_on_node"] for r in ref["results"]] == [n] * n
    grad_bytes = sum(w.nbytes for w in multi["results"][0]["weights"])
    print(
        f"\n{n} hosts: bytes sent by each host: {multi['sent']} "
        f"({TRAIN_STEPS} steps x {grad_bytes} gradient bytes, plus timing phases)"
    )
    for host, sent in multi["sent"].items():
        # Every host sends at least half of each step's gradient buffer in the
        # allreduce (ring / recursive halving); via shared memory it would be ~0.
        assert sent >= TRAIN_STEPS * grad_bytes // 2, (host, sent)

    worst_loss = max(
        abs(a - b) for a, b in zip(multi["results"][0]["losses"], ref["results"][0]["losses"])
    )
    worst_weight = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(multi["results"][0]["weights"], ref["results"][0]["weights"])
    )
    print(
        f"{n} hosts vs mpiexec -n {n} on one host: max |loss diff| {worst_loss:.3g}, "
        f"max |weight diff| {worst_weight:.3g} over {TRAIN_STEPS} steps"
    )
    for run in (multi, ref):
        for r in run["results"][1:]:
            for a, b in zip(r["weights"], run["results"][0]["weights"]):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {r['rank']} differs from rank 0")
    assert worst_loss <= 1e-6 and worst_weight <= 1e-6
    # The steps trained something (equal but frozen weights would also agree).
    assert multi["results"][0]["losses"][-1] < multi["results"][0]["losses"][0]


# -- 2. alpha-beta cost model -------------------------------------------------------------------
# What one step of PROGRAM sends, read from the code (mpi_strategy at the time
# of writing) and counted at run time by CountingComm on rank 0:
#   - the gradients: one fused float32 Allreduce of all B = 407,080 bytes (plus
#     any alignment padding; cross_device_ops -> fusion), after the agreement
#     Allgather with which the ranks agree on the collective (agreement.py);
#   - optimizer.iterations += 1: the variable is ONLY_FIRST_REPLICA, so TF
#     broadcasts the new value (strategy broadcast_to: Allgather + 8-byte Bcast);
#   - strategy.reduce("SUM", loss): Allgather + 4-byte Allreduce.
#   (The input is an infinite dataset, so the iterator adds no end-of-data vote.)
# The model below uses the counted list, so it follows the library if the
# per-collective protocol changes; the test pins only the fused gradient buffer.
#
# Bandwidth term. With 2 ranks every MPICH algorithm sends each rank's whole
# Allreduce buffer once (recursive doubling: one exchange of B; reduce-scatter
# + allgather: B/2 then B/2), and each Allgather / Bcast sends its own bytes:
# each host's egress carries ~ the logged bytes per step, both directions at
# once. TCP over the 1500-byte MTU puts 1448 payload bytes into each
# 1514-byte frame, which is what tbf counts, plus a per-message allowance of
# 64 bytes for UCX's and TCP's headers:
#     t(rate) = t(unshaped) + sum_msgs(b + ceil(b / 1448) * 66 + 64) / rate
# Latency term. At 2 ranks every one of these collectives is a single exchange
# (one one-way trip), except the large Allreduce, which MPICH runs as
# reduce-scatter + allgather (two trips). With delay d on each host's egress:
#     t(delay) = t(unshaped) + (collectives + 1) * d
RATE_TOLERANCE = (0.75, 1.35)  # measured extra time / predicted (2 shared cores)
DELAY_TOLERANCE = (0.7, 1.6)  # looser: UCX's rendezvous handshake may add a trip


def _wire_bytes(payload):
    return payload + -(-payload // 1448) * 66 + 64


def test_step_time_follows_alpha_beta_model(two_hosts):
    _assert_ran(two_hosts)
    rank0 = two_hosts["results"][0]
    phases = rank0["phases"]
    assert [p["name"] for p in phases] == [p["name"] for p in two_hosts["phase_specs"]]

    grad_bytes = sum(w.nbytes for w in rank0["weights"])
    collectives = phases[0]["collectives"]
    per_step = len(collectives) // TIMED_STEPS
    steps = [collectives[i * per_step : (i + 1) * per_step] for i in range(TIMED_STEPS)]
    assert len(collectives) == per_step * TIMED_STEPS and all(s == steps[0] for s in steps), (
        f"steps issue different collectives: {collectives}"
    )
    large = [c for c in steps[0] if c[1] >= 1024]
    # (The fused buffer may pad its members for alignment: allow a few bytes each.)
    assert (
        len(large) == 1
        and large[0][0] == "Allreduce"
        and grad_bytes <= large[0][1] <= grad_bytes + 1024
    ), f"expected one fused gradient Allreduce of ~{grad_bytes} bytes per step: {steps[0]}"
    payload = sum(b for _, b in steps[0])
    wire = sum(_wire_bytes(b) for _, b in steps[0])

    median = {p["name"]: float(np.median(p["step_times"])) for p in phases}
    base = min(median["none"], median["none again"])
    lines = [
        f"per step: {per_step} collectives {steps[0]}",
        f"unshaped: {base * 1e3:.1f} ms/step; {payload} payload bytes per host per "
        f"step ({wire} on the wire)",
    ]
    failures = []
    for spec in two_hosts["phase_specs"]:
        shaping = spec["shaping"]
        if not shaping:
            continue
        if "delay_ms" in shaping:
            extra_predicted = (per_step + 1) * shaping["delay_ms"] / 1e3
            low, high = DELAY_TOLERANCE
        else:
            extra_predicted = wire * 8 / (shaping["rate_mbit"] * 1e6)
            low, high = RATE_TOLERANCE
        extra = median[spec["name"]] - base
        ratio = extra / extra_predicted
        lines.append(
            f"{spec['name']}: measured {median[spec['name']] * 1e3:.1f} ms/step, "
            f"predicted {(base + extra_predicted) * 1e3:.1f} ms "
            f"(extra {extra * 1e3:.1f} vs {extra_predicted * 1e3:.1f} ms, "
            f"ratio {ratio:.2f}, allowed {low}-{high})"
        )
        if not low <= ratio <= high:
            failures.append(spec["name"])
    if not any("delay_ms" in s["shaping"] for s in two_hosts["phase_specs"]):
        lines.append("delay phases not run: this kernel has no netem qdisc (sch_netem)")
    print("\n" + "\n".join(lines))
    assert not failures, "\n".join(lines)


def _extra_time_at(info, rate_mbit):
    median = {p["name"]: float(np.median(p["step_times"])) for p in info["results"][0]["phases"]}
    return median[f"rate {rate_mbit} Mbit/s"] - min(median["none"], median["none again"])


def test_float16_compression_halves_gradient_bytes_and_bandwidth_time(two_hosts, two_hosts_float16):
    _assert_ran(two_hosts)
    _assert_ran(two_hosts_float16)
    compressed = two_hosts_float16["results"]
    weights = compressed[0]["weights"]
    # Both hosts end with the same weights, and the compressed run trained.
    for w0, w1 in zip(weights, compressed[1]["weights"]):
        np.testing.assert_array_equal(w0, w1)
    assert compressed[0]["losses"][-1] < compressed[0]["losses"][0]

    # The 784 x 128 kernel (401,408 bytes in float32; the only tensor over
    # compression.MIN_BYTES) crosses as 16-bit values: rank 0 sends half of
    # its Alltoall buffer and all of its Allgatherv slice, 2 x 100,352 bytes.
    phase = compressed[0]["phases"][0]
    step = phase["collectives"][: len(phase["collectives"]) // TIMED_STEPS]
    kernel = weights[0].size
    alltoall = [b for name, b in step if name == "Alltoall"]
    assert alltoall == [kernel * 2], step
    assert not [b for name, b in step if name == "Allreduce" and b >= kernel], step
    assert [b for name, b in step if name == "Allgatherv" and b >= kernel // 2] == [kernel + 8], (
        step
    )  # + the 8-byte row-count header

    plain, half = _extra_time_at(two_hosts, 10), _extra_time_at(two_hosts_float16, 10)
    print(
        f"\nextra step time at 10 Mbit/s: float32 {plain * 1e3:.1f} ms, "
        f"float16 {half * 1e3:.1f} ms (ratio {half / plain:.2f})"
    )
    assert 0.35 <= half / plain <= 0.7, (plain, half)


# -- 3. a host dies ----------------------------------------------------------------------------
def test_killing_one_host_ends_the_job(three_hosts):
    info = three_hosts
    plain = re.sub(r"\[\d+\] ?", "", info["out"])
    assert info["killed"].get("pids"), (
        f"no python found to kill on {info['victim']}:\n{info['out'][-5000:]}"
    )
    after_kill = info["ended"] - info["killed"]["at"]
    print(
        f"\njob ended {after_kill:.1f} s after SIGKILL of {info['victim']}'s python, "
        f"exit code {info['code']}; MPICH printed:\n"
        + "\n".join(line for line in plain.splitlines() if line.strip())[-3000:]
    )
    assert info["code"] != 0
    assert after_kill < KILL_DEADLINE_S
    assert "BAD TERMINATION" in plain and info["victim"] in plain, plain[-3000:]
    print(
        f"last process of the job gone {info['all_gone'] - info['killed']['at']:.1f} s "
        "after the SIGKILL"
    )
    assert info["left_in_namespaces"] == {}, "processes left on the hosts"
    assert info["left_in_root"] == [], "processes of the job left on the launching node"
    assert info["all_gone"] - info["killed"]["at"] < KILL_DEADLINE_S


# -- 4. saving on a shared filesystem and on node-local disks -----------------------------------
# Every rank runs the same saves with the same paths, then loads what it saved
# from its own view of the path (tests/programs/multihost_saving.py).
RANKS_PER_HOST = 2


def _files(directory):
    return {
        os.path.relpath(os.path.join(d, f), directory): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(directory)
        for f in files
    }


def test_save_lands_once_per_filesystem_shared_and_node_local(tmp_path):
    """2 hosts x 2 ranks save into a shared directory and into a node-local one."""
    shared, local, out = tmp_path / "shared", tmp_path / "local", tmp_path / "out"
    shared.mkdir()
    out.mkdir()
    hosts = _new_cluster(2, private_dirs=(str(local),))
    try:
        n = hosts.n_hosts * RANKS_PER_HOST
        argv = [
            *hosts.mpiexec_args(ranks_per_host=RANKS_PER_HOST),
            sys.executable,
            SAVE_PROGRAM,
            "--out",
            str(out),
            "--dirs",
            f"shared={shared}",
            f"local={local}",
        ]
        code, output = run_mpiexec(n, argv, silence=300, env=hosts.mpi_env())
        assert code == 0, output[-5000:]
        reports = [json.loads((out / f"report{r}.json").read_text()) for r in range(n)]
        copies = {
            "shared": {"all": _files(shared)},
            "local": {h: _files(hosts.private_copy(h, str(local))) for h in hosts.hosts},
        }
        local_seen_from_root = _files(local)
    finally:
        hosts.close()

    # The layout the write points rely on: ranks fill hosts in order, and each
    # host is one MPI node (COMM_TYPE_SHARED), whatever its hostname.
    assert [(r["host"], r["node_rank"], r["node_size"]) for r in reports] == [
        (h, i, RANKS_PER_HOST) for h in hosts.hosts for i in range(RANKS_PER_HOST)
    ]
    writers = {
        "shared": {0},
        "local": {min(r["rank"] for r in reports if r["host"] == h) for h in hosts.hosts},
    }
    lines, failures = [], []
    for key in reports[0]["saves"]:
        place = key.split()[0]
        row = {r["rank"]: r["saves"][key] for r in reports}
        lines.append(
            f"{key}: write_bytes per rank { {rank: e['write_bytes'] for rank, e in row.items()} }"
        )
        for rank, entry in row.items():
            if not entry["loaded"]:
                failures.append(
                    f"{key}: rank {rank} could not load its copy: "
                    f"{entry.get('error', 'different weights')}"
                )
            written = entry["write_bytes"]
            if rank in writers[place] and written < 1 << 20:
                failures.append(
                    f"{key}: rank {rank} should write its filesystem's copy "
                    f"but wrote {written} bytes"
                )
            if rank not in writers[place] and written > FIRST_CALL_BYTES:
                failures.append(f"{key}: rank {rank} wrote {written} bytes (a second copy?)")
    lines += [
        f"{place} copy at {where}: {sorted(files)} ({sum(files.values())} bytes)"
        for place, by_host in copies.items()
        for where, files in by_host.items()
    ]
    print("\n" + "\n".join(lines))
    assert not failures, "\n".join(failures + lines)

    # One complete copy per filesystem and nothing else (no probe files, no
    # temporary files): the shared directory holds one, each host's node-local
    # directory its own, and the node-local writes never reached the shared disk.
    expected = {
        "ckpt/checkpoint",
        "ckpt/ckpt-1.index",
        "ckpt/ckpt-1.data-00000-of-00001",
        "x.keras",
    }
    assert set(copies["shared"]["all"]) == expected, copies
    for host, files in copies["local"].items():
        assert set(files) == expected, (host, copies)
    assert local_seen_from_root == {}
