"""An alpha-beta scaling model of synchronous data-parallel training.

Allreduce algorithm: Rabenseifner's (reduce-scatter by recursive halving, then
allgather by recursive doubling; MPICH's default for large messages and
power-of-two rank counts)::

    T_allreduce(p, n) = 2 log2(p) alpha + 2 (p-1)/p n beta

with alpha the latency per message (s), beta the time per byte (s/B) and n the
bytes reduced. The local summation (gamma term) is folded into beta. At the
calibration point p = 2 this is ``2 alpha + n beta``; alpha and beta are
fitted by least squares on the raw ``MPI_Allreduce`` times of
``benchmarks/collectives.py``, each point weighted by 1/time so that the
microsecond points fix alpha and the megabyte points fix beta.

A training step of one replica (one rank per core, per-replica batch b) is::

    T_step(p) = b x t_sample + T_allreduce(p, 4 x parameters)

with t_sample the per-sample compute time measured without a strategy on one
core of this machine (forward, backward and SGD update at batch b), and
nothing overlapping. With buckets (``CommunicationOptions.bytes_per_pack``,
last layers first) the backward pass hides part of the reduction::

    T_step(p) = T_c + max(sum_k T_allreduce(p, n_k) - w T_c, T_allreduce(p, n_last))

with ``w`` (``OVERLAP_WINDOW``) the share of the compute that remains after
the first bucket is ready, and ``n_last`` the first layers' bucket, which is
ready only when the backward pass ends. Each step is also labelled by its
largest term: compute-bound (T_c), latency-bound (2 log2(p) alpha) or
bandwidth-bound (2 (p-1)/p n beta). Throughput speedup over one core is
``p x T_step(1) / T_step(p)`` (weak scaling: the per-replica batch stays b, as
in the paper's runs).

On more than one node every step of the allreduce is charged at the slower
of the network's and the node's alpha and beta (pessimistic: in a node-ordered
ring or halving schedule some steps stay inside a node). Networks other than
this machine's shared memory are *assumed* figures, not measurements: see
``NETWORKS``.

    python -m benchmarks.cost_model benchmarks/results/latest.json   # re-project from results
"""

import json
import math
import sys

import numpy as np

# The agreement modelled is the library's own (its protocol, not a copy of it).
from mpi_strategy._src.core.protocol import HASHED_ABOVE, record_bytes

ALGORITHM = (
    "Rabenseifner (recursive-halving reduce-scatter + recursive-doubling "
    "allgather): 2 log2(p) alpha + 2 (p-1)/p n beta"
)

# Assumed inter-node networks: typical achievable MPI figures, not measured here.
NETWORKS = {
    "10GbE (assumed: alpha 50 us, 1.1 GB/s)": {"alpha": 50e-6, "beta": 1 / 1.1e9},
    "InfiniBand FDR (assumed: alpha 2 us, 6 GB/s)": {"alpha": 2e-6, "beta": 1 / 6.0e9},
}
# Overlap: the share of a step's compute left when the first (last layers')
# bucket is ready (assumed: backward is ~2/3 of the step, and the last layers'
# gradients come a little after it starts), and the bucket size projected.
OVERLAP_WINDOW = 0.5
BYTES_PER_PACK = 256 << 10
CORES_PER_NODE = 20  # assumed (the paper's Higgs run goes 20 -> 80 cores, i.e. 1 -> 4 nodes)
CORE_COUNTS = [1, 2, 4, 8, 16, 20, 32, 40, 64, 80, 160, 320]  # 320 = 16 nodes

# The paper's workloads (Vishnu et al. 2016): benchmarks/models.py name,
# per-replica batch, and the paper's reported speedup as (cores, speedup, base cores).
PAPER_WORKLOADS = {
    "MNIST LeNet-3": {"model": "lenet3", "batch": 32, "paper": (16, 3.0, 1)},
    "CIFAR-10 CNN": {"model": "cnn", "batch": 32, "paper": (64, 3.37, 1)},
    "Higgs DNN": {"model": "higgs", "batch": 32, "paper": (80, 2.6, 20)},
}


def allreduce_time(nbytes, p, alpha, beta):
    """Seconds for an allreduce of ``nbytes`` over ``p`` ranks (0 for one rank)."""
    if p <= 1:
        return 0.0
    return 2 * math.log2(p) * alpha + 2 * (p - 1) / p * nbytes * beta


def fit_alpha_beta(nbytes, seconds, ranks):
    """Least-squares alpha (s) and beta (s/B) from raw allreduce times at ``ranks``.

    Each point is weighted by 1/time (relative residuals). Returns a dict with
    alpha, beta and the relative RMS error of the fit.
    """
    n = np.asarray(nbytes, float)
    t = np.asarray(seconds, float)
    if ranks < 2:
        raise ValueError("calibration needs raw allreduce times at >= 2 ranks")
    if len(n) < 2 or len(set(n.tolist())) < 2:
        raise ValueError("calibration needs at least two different message sizes")
    if np.any(t <= 0):
        raise ValueError("allreduce times must be positive")
    design = np.stack([np.full_like(n, 2 * math.log2(ranks)), 2 * (ranks - 1) / ranks * n], 1)
    weights = 1 / t
    (alpha, beta), *_ = np.linalg.lstsq(design * weights[:, None], t * weights, rcond=None)
    if alpha < 0 or beta <= 0:  # the noise won; fall back to the two extremes
        beta = max((t[n.argmax()] - t[n.argmin()]) / (n.max() - n.min()), 1e-15)
        beta /= 2 * (ranks - 1) / ranks
        alpha = max(t[n.argmin()] - 2 * (ranks - 1) / ranks * n.min() * beta, 0.0)
        alpha /= 2 * math.log2(ranks)
    predicted = design @ np.array([alpha, beta])
    return {
        "alpha_s": float(alpha),
        "beta_s_per_byte": float(beta),
        "ranks": ranks,
        "bandwidth_GBps": float(1 / beta / 1e9),
        "relative_rms_error": float(np.sqrt(np.mean(((predicted - t) / t) ** 2))),
    }


def step_time(p, compute_s, nbytes, intra, network, cores_per_node=CORES_PER_NODE):
    """Projected seconds per step at ``p`` ranks (one per core)."""
    if p <= cores_per_node:
        link = intra
    else:  # a multi-node allreduce is as slow as the slower of the two links
        link = {k: max(intra[k], network[k]) for k in ("alpha", "beta")}
    return compute_s + allreduce_time(nbytes, p, link["alpha"], link["beta"])


def link_at(p, intra, network, cores_per_node=CORES_PER_NODE):
    """alpha and beta of an allreduce over ``p`` ranks (one per core)."""
    if p <= cores_per_node:
        return intra
    return {k: max(intra[k], network[k]) for k in ("alpha", "beta")}


def bucket_bytes(nbytes, bytes_per_pack=BYTES_PER_PACK):
    """Bytes of each bucket, first reduced first: equal buckets of at most ``bytes_per_pack``."""
    k = max(1, math.ceil(nbytes / bytes_per_pack)) if bytes_per_pack > 0 else 1
    return [nbytes / k] * k


def overlapped_step_time(p, compute_s, buckets, link, window=OVERLAP_WINDOW):
    """Seconds per step when bucket k's allreduce may run during the backward pass.

    The last ``window`` x compute hides reduction time, except the last
    bucket's (the first layers', ready only at the end of the backward pass).
    Never below ``max(compute, total reduction)``.
    """
    times = [allreduce_time(b, p, link["alpha"], link["beta"]) for b in buckets]
    exposed = max(sum(times) - window * compute_s, times[-1])
    return compute_s + exposed


def bound_by(p, compute_s, nbytes, link):
    """Which term of an unbucketed step is largest: compute, latency or bandwidth."""
    if p <= 1:
        return "compute-bound"
    latency = 2 * math.log2(p) * link["alpha"]
    bandwidth = 2 * (p - 1) / p * nbytes * link["beta"]
    largest = max(compute_s, latency, bandwidth)
    if largest == compute_s:
        return "compute-bound"
    return "latency-bound" if largest == latency else "bandwidth-bound"


def project(workloads, intra, networks=None, core_counts=None, cores_per_node=CORES_PER_NODE):
    """Projected step time and speedup for each workload, network and core count.

    Args:
      workloads: {name: {"params": int, "compute_s": per-replica step compute time}}.
      intra: {"alpha", "beta"} inside a node (the calibration).
      networks: {label: {"alpha", "beta"}} between nodes (default ``NETWORKS``).

    Returns:
      A list of dicts (workload, network, cores, nodes, step_ms, speedup).
    """
    networks = NETWORKS if networks is None else networks
    core_counts = CORE_COUNTS if core_counts is None else core_counts
    rows = []
    for name, w in workloads.items():
        nbytes = 4 * w["params"]
        for label, net in networks.items():
            one = step_time(1, w["compute_s"], nbytes, intra, net, cores_per_node)
            for p in core_counts:
                t = step_time(p, w["compute_s"], nbytes, intra, net, cores_per_node)
                link = link_at(p, intra, net, cores_per_node)
                overlapped = overlapped_step_time(p, w["compute_s"], bucket_bytes(nbytes), link)
                rows.append(
                    {
                        "workload": name,
                        "network": label,
                        "cores": p,
                        "nodes": math.ceil(p / cores_per_node),
                        "step_ms": t * 1e3,
                        "allreduce_ms": (t - w["compute_s"]) * 1e3,
                        "speedup": p * one / t,
                        "overlapped_step_ms": overlapped * 1e3,
                        "overlapped_speedup": p * one / overlapped,
                        "bound": bound_by(p, w["compute_s"], nbytes, link),
                    }
                )
    return rows


def allgather_time(nbytes, p, alpha, beta):
    """Seconds for an allgather of ``nbytes`` from each of ``p`` ranks
    (recursive doubling: log2(p) rounds, (p-1) x nbytes received)."""
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * alpha + (p - 1) * nbytes * beta


ENGINE_CORES = [1, 16, 20, 64, 80, 320, 1024, 4096]


def agreement_time(p, alpha, beta, hashed=None):
    """Seconds for the agreement before a collective: an allgather of
    ``record_bytes(p)`` per rank, or above ``HASHED_ABOVE`` ranks (or with
    ``hashed``) one allreduce of 24 bytes (recursive doubling: log2(p) rounds)."""
    if p <= 1:
        return 0.0
    if hashed if hashed is not None else p > HASHED_ABOVE:
        return math.ceil(math.log2(p)) * (alpha + 24 * beta)
    return allgather_time(record_bytes(p), p, alpha, beta)


def engine_projection(
    workloads, intra, fixed_s, collectives=2, networks=None, cores_per_node=CORES_PER_NODE
):
    """Step time and speedup per engine: each collective costs its engine's
    fixed cost (``fixed_s``: {engine: seconds beyond MPI}, measured) and the
    agreement (``agreement_time``) on top of the model's allreduce;
    ``collectives`` per step (the fused gradients and the loss). Rows also
    give the agreement's share of the step, and what it would be if every
    record were gathered at every size (``gathered_agreement_share``)."""
    networks = NETWORKS if networks is None else networks
    rows = []
    for name, w in workloads.items():
        nbytes = 4 * w["params"]
        for label, net in networks.items():
            for engine, fixed in fixed_s.items():

                def at(p, hashed=None, fixed=fixed, net=net, nbytes=nbytes, w=w):
                    link = link_at(p, intra, net, cores_per_node)
                    agreement = agreement_time(p, link["alpha"], link["beta"], hashed)
                    reduce = allreduce_time(nbytes, p, link["alpha"], link["beta"])
                    fixed_p = fixed if p > 1 else 0.0
                    return w["compute_s"] + collectives * (fixed_p + agreement) + reduce, agreement

                one, _ = at(1)
                for p in ENGINE_CORES:
                    t, agreement = at(p)
                    t_gathered, gathered = at(p, hashed=False)
                    rows.append(
                        {
                            "workload": name,
                            "network": label,
                            "engine": engine,
                            "cores": p,
                            "step_ms": t * 1e3,
                            "speedup": p * one / t,
                            "agreement_share": collectives * agreement / t,
                            "gathered_agreement_share": collectives * gathered / t_gathered,
                        }
                    )
    return rows


def engine_comparison(rows):
    """The paper's table (speedup at its core counts over its base) per engine."""
    out = []
    for name, spec in PAPER_WORKLOADS.items():
        cores, paper, base = spec["paper"]
        for label in NETWORKS:
            row = {"workload": name, "network": label, "cores": cores, "paper_speedup": paper}
            for engine in sorted({r["engine"] for r in rows}):
                by = {
                    r["cores"]: r
                    for r in rows
                    if (r["workload"], r["network"], r["engine"]) == (name, label, engine)
                }
                row[f"{engine}_speedup"] = by[cores]["speedup"] / by[base]["speedup"]
                row[f"{engine}_agreement_share_at_4096"] = by[4096]["agreement_share"]
                row[f"{engine}_gathered_agreement_share_at_4096"] = by[4096][
                    "gathered_agreement_share"
                ]
            out.append(row)
    return out


def speedup_at(rows, workload, network, cores, base=1, key="speedup"):
    by_cores = {
        r["cores"]: r[key] for r in rows if r["workload"] == workload and r["network"] == network
    }
    return by_cores[cores] / by_cores[base]


def bounds_between(rows, workload, network, low, high):
    """{cores: bound} of ``workload`` on ``network`` for low <= cores <= high."""
    return {
        r["cores"]: r["bound"]
        for r in rows
        if r["workload"] == workload and r["network"] == network and low <= r["cores"] <= high
    }


def calibrate_from_results(report):
    """The intra-node alpha/beta fitted on a results report's raw Allreduce rows."""
    rows = [c for c in report["collectives"] if c.get("kind", "reduce") == "reduce"]
    return fit_alpha_beta(
        [c["bytes"] for c in rows], [c["raw_allreduce_ms"] / 1e3 for c in rows], rows[0]["ranks"]
    )


def model_report(report):
    """The cost-model section of a results report (needs collectives and compute rows)."""
    fit = calibrate_from_results(report)
    intra = {"alpha": fit["alpha_s"], "beta": fit["beta_s_per_byte"]}
    workloads = {}
    for name, spec in PAPER_WORKLOADS.items():
        c = report["compute"][spec["model"]]
        workloads[name] = {
            "params": c["params"],
            "compute_s": c["ms_per_step"] / 1e3,
            "per_sample_ms": c["ms_per_step"] / c["global_batch"],
        }
    rows = project(workloads, intra)
    comparison = []
    for name, spec in PAPER_WORKLOADS.items():
        cores, paper, base = spec["paper"]
        for label in NETWORKS:
            at = next(
                r
                for r in rows
                if r["workload"] == name and r["network"] == label and r["cores"] == cores
            )
            comparison.append(
                {
                    "workload": name,
                    "network": label,
                    "cores": cores,
                    "base_cores": base,
                    "paper_speedup": paper,
                    "projected_step_ms": at["step_ms"],
                    "projected_allreduce_ms": at["allreduce_ms"],
                    "projected_speedup": speedup_at(rows, name, label, cores, base),
                    "projected_speedup_overlapped": speedup_at(
                        rows, name, label, cores, base, "overlapped_speedup"
                    ),
                    "bound": at["bound"],
                    "bound_16_to_64_cores": bounds_between(rows, name, label, 16, 64),
                }
            )
    return {
        "algorithm": ALGORITHM,
        "calibration": fit,
        "networks": NETWORKS,
        "overlap": {"window": OVERLAP_WINDOW, "bytes_per_pack": BYTES_PER_PACK},
        "cores_per_node": CORES_PER_NODE,
        "workloads": workloads,
        "projection": rows,
        "paper_comparison": comparison,
    }


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/latest.json"
    with open(path) as f:
        report = json.load(f)
    model = model_report(report)
    print(
        json.dumps(
            {k: model[k] for k in ("algorithm", "calibration", "workloads", "paper_comparison")},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
