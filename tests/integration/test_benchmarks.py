"""Smoke test of the benchmark suite: the cost model and one tiny variant end to end.

The figures themselves come from ``python -m benchmarks`` (docs/benchmarks.md);
this only checks that the machinery measures and projects sanely.
"""

import itertools
import math
import os

import pytest

from benchmarks import cost_model  # the repository root is on sys.path (conftest.py)

ALPHA, BETA = 5e-6, 1 / 2e9  # a fake machine: 5 us per message, 2 GB/s


def _fake_calibration(ranks=2):
    sizes = [4, 4096, 65536, 1048576, 7450000, 67108864]
    return sizes, [cost_model.allreduce_time(n, ranks, ALPHA, BETA) for n in sizes]


@pytest.mark.single_process
def test_cost_model_fits_and_projects_sanely():
    for ranks in (2, 4):
        fit = cost_model.fit_alpha_beta(*_fake_calibration(ranks), ranks)
        assert math.isclose(fit["alpha_s"], ALPHA, rel_tol=1e-6), fit
        assert math.isclose(fit["beta_s_per_byte"], BETA, rel_tol=1e-6), fit
        assert fit["relative_rms_error"] < 1e-6
    with pytest.raises(ValueError, match="two different message sizes"):
        cost_model.fit_alpha_beta([8, 8], [1e-5, 1e-5], 2)

    intra = {"alpha": ALPHA, "beta": BETA}
    workloads = {
        "small": {"params": 10_000, "compute_s": 0.05},
        "large": {"params": 50_000_000, "compute_s": 0.05},
    }
    rows = cost_model.project(workloads, intra)
    for name in workloads:
        for label in cost_model.NETWORKS:
            mine = sorted(
                (r for r in rows if r["workload"] == name and r["network"] == label),
                key=lambda r: r["cores"],
            )
            assert mine[0]["cores"] == 1 and math.isclose(mine[0]["speedup"], 1.0)
            for a, b in itertools.pairwise(mine):
                assert b["step_ms"] >= a["step_ms"]  # more ranks never communicate less
                assert b["speedup"] <= b["cores"] + 1e-9
                if name == "small":  # compute-bound: more cores, more throughput
                    assert a["speedup"] < b["speedup"]
            # More parameters to reduce: slower steps, lower speedup at every core count.
            other = {r["cores"]: r for r in rows if r["workload"] != name and r["network"] == label}
            for r in mine[1:]:
                bigger = r if name == "large" else other[r["cores"]]
                smaller = other[r["cores"]] if name == "large" else r
                assert bigger["speedup"] < smaller["speedup"]
    # A faster network never projects a lower speedup.
    slow, fast = list(cost_model.NETWORKS)
    assert cost_model.NETWORKS[slow]["beta"] > cost_model.NETWORKS[fast]["beta"]
    for p in (40, 80, 320):
        assert cost_model.speedup_at(rows, "large", fast, p) > cost_model.speedup_at(
            rows, "large", slow, p
        )


@pytest.mark.single_process
def test_overlap_hides_at_most_the_backward_pass_and_each_step_is_labelled_by_its_bound():
    link = {"alpha": ALPHA, "beta": BETA}
    compute = 0.01
    for nbytes in (4e3, 1e6, 4e7, 4e8):  # from hidden entirely to much longer than compute
        buckets = cost_model.bucket_bytes(nbytes)
        assert math.isclose(sum(buckets), nbytes) and max(buckets) <= cost_model.BYTES_PER_PACK
        unbucketed = cost_model.step_time(8, compute, nbytes, link, link)
        overlapped = cost_model.overlapped_step_time(8, compute, buckets, link)
        reduction = sum(cost_model.allreduce_time(b, 8, ALPHA, BETA) for b in buckets)
        assert max(compute, reduction) <= overlapped + 1e-12  # never better than the max
        last = cost_model.allreduce_time(buckets[-1], 8, ALPHA, BETA)
        assert overlapped >= compute + last - 1e-12  # the first layers' bucket waits
        if len(buckets) == 1:
            assert math.isclose(overlapped, unbucketed)  # one bucket: nothing to overlap
        else:  # hides up to the window of compute, minus the extra latencies of the buckets
            extra_latency = (len(buckets) - 1) * 2 * math.log2(8) * ALPHA
            assert (
                overlapped
                <= unbucketed
                + extra_latency
                - min(cost_model.OVERLAP_WINDOW * compute, reduction - last)
                + 1e-12
            )
    assert cost_model.bound_by(1, compute, 4e8, link) == "compute-bound"
    assert cost_model.bound_by(64, compute, 4e3, link) == "compute-bound"
    assert cost_model.bound_by(64, compute, 4e8, link) == "bandwidth-bound"
    assert cost_model.bound_by(64, 1e-6, 8, link) == "latency-bound"

    # The paper's workloads: a label and an overlapped speedup per network and core count.
    workloads = {
        "tiny": {"params": 1_000, "compute_s": 1e-3},
        "large": {"params": 50_000_000, "compute_s": 0.05},
    }
    rows = cost_model.project(workloads, link)
    bounds = cost_model.bounds_between(rows, "large", next(iter(cost_model.NETWORKS)), 16, 64)
    assert set(bounds) == {16, 20, 32, 40, 64} and set(bounds.values()) == {"bandwidth-bound"}
    for r in rows:
        assert r["overlapped_step_ms"] <= r["step_ms"] + 1e3 * (
            math.ceil(4 * workloads[r["workload"]]["params"] / cost_model.BYTES_PER_PACK)
            * 2
            * math.log2(max(r["cores"], 2))
            * max(ALPHA, *(n["alpha"] for n in cost_model.NETWORKS.values()))
        )


@pytest.mark.single_process
def test_one_tiny_training_variant_end_to_end():
    from benchmarks.launching import train_variant
    from benchmarks.report import MODEL_NAMES, markdown, rss_ratio

    row = train_variant("embedding", "no_strategy", ranks=2, batch=8, steps=2, warmup=1)
    assert row["error"] is None, row
    assert row["ms_per_step"] > 0 and row["samples_per_s"] == pytest.approx(
        8 / row["ms_per_step"] * 1e3
    )
    assert 100 < max(row["peak_rss_mb"]) < 20000
    assert row["params"] == 100_000 * 64 + 64 * 64 + 64 + 64 * 10 + 10
    assert "IndexedSlices" in row["grad_types_before_reduce"]
    assert "IndexedSlices" in row["grad_types_after_reduce"]
    # The report renders a (partial) run with that row.
    sizes, seconds = _fake_calibration()
    result = {
        "ranks": 3,
        "quick": True,
        "command": "test",
        "time": "now",
        "duration_s": 1,
        "engine": "python",
        "load_before": "0",
        "load_after": "0",
        "machine": {"cores": 2, "cpu": "x", "memory_GiB": 1, "python": "3", "versions": {}},
        "collectives": [
            {
                "bytes": n,
                "raw_allreduce_ms": t * 1e3,
                "reduce_overhead_ms": 0.1,
                "ratio_to_raw": 1.0,
                "raw_bus_bandwidth_GBps": 1.0,
                "strategy_bus_bandwidth_GBps": 1.0,
                "ranks": 2,
            }
            for n, t in zip(sizes, seconds)
        ],
        "batch_reduce": [],
        "train_step": [row],
        "compute": {
            m: {"params": 1000, "ms_per_step": 32.0, "global_batch": 32}
            for m in ("lenet3", "cnn", "higgs")
        },
    }
    result["cost_model"] = cost_model.model_report(result)
    assert rss_ratio(result, "embedding", "no_strategy") == 1.0
    text = markdown(result)
    assert "| " + MODEL_NAMES["embedding"] + " (8) | no strategy, 1 process |" in text
    assert "### Collectives (3 ranks," in text
    assert text.splitlines()[0].endswith(
        "3 ranks (QUICK: few repeats, not for quoting); engine: python."
    )


@pytest.mark.single_process
def test_timeline_summary_splits_each_step(tmp_path):
    from benchmarks import timeline_view

    events = []
    for rank in (0, 1):
        for step in range(6):  # a 1 ms step: an allreduce (0.2 ms wait, 0.1 ms transfer)
            t = 1000.0 * step + 300 + 50 * rank  # and a small broadcast
            for name, ts, wait, transfer in [
                ("allreduce", t, 200, 100),
                ("broadcast", t + 400, 10, 5),
            ]:
                events += [
                    {"ph": "X", "pid": rank, "name": name, "ts": ts, "dur": wait + transfer},
                    {"ph": "X", "pid": rank, "name": "wait for ranks", "ts": ts, "dur": wait},
                    {"ph": "X", "pid": rank, "name": "transfer", "ts": ts + wait, "dur": transfer},
                ]
    rows = timeline_view.summary(events)
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["collectives_per_step"] == 2 and r["step_ms"] == pytest.approx(1.0)
        assert r["wait_ms"] == pytest.approx(0.21) and r["transfer_ms"] == pytest.approx(0.105)
        assert r["outside_ms"] == pytest.approx(1.0 - 0.21 - 0.105)
    png = timeline_view.plot(events, str(tmp_path / "t.png"), "synthetic")
    assert os.path.getsize(png) > 1000


@pytest.mark.single_process
def test_elastic_part_launches_elastic_mode_under_ulfm_and_reports_the_ratio():
    # One short launch (about 15 s): the full comparison is `python -m benchmarks --elastic`.
    from benchmarks import elastic

    mpirun, reason = elastic.find_mpirun()
    if reason:
        pytest.skip(reason)
    row = elastic.launch(mpirun, "on", steps=2, warmup=1)
    assert "error" not in row, row
    # The MLP's variables and SGD's scalars (iterations, learning rate).
    assert 4 * 1_863_690 < row["mlp"]["state_bytes"] <= 4 * 1_863_690 + 64
    off = dict(row, variant="off", round=0)
    part = {
        "ranks": 2,
        "mpirun": mpirun,
        "global_batch": 256,
        "steps": 2,
        "warmup": 1,
        "rounds": 1,
        "commit_every": 10,
        "target": elastic.TARGET,
        "launches": [off, dict(row, round=0), dict(row, variant="on, no commits", round=0)],
    }
    part["models"] = {m: elastic.summary(part["launches"], m) for m in elastic.MODELS}
    assert part["models"]["mlp"]["on"]["ratio"]["ms_per_step"]["of_medians"] == 1.0
    text = "\n".join(elastic.markdown(part))
    assert "| mlp (7.45 MB) | on | " in text and "target <= 1.03: met" in text


def test_the_agreement_is_projected_hashed_above_1024_ranks():
    link = cost_model.NETWORKS["10GbE (assumed: alpha 50 us, 1.1 GB/s)"]
    a, b = link["alpha"], link["beta"]
    assert cost_model.agreement_time(1024, a, b) == cost_model.allgather_time(128, 1024, a, b)
    hashed, gathered = (cost_model.agreement_time(4096, a, b, h) for h in (True, False))
    assert cost_model.agreement_time(4096, a, b) == hashed == 12 * (a + 24 * b)
    assert gathered == 12 * a + 4095 * 128 * b > hashed  # the O(ranks) bytes are gone


@pytest.mark.single_process
def test_kernels_part_measures_both_engines_and_projects_the_papers_table():
    # One overhead launch per engine (seconds each); the full comparison is
    # `python -m benchmarks --kernels`.
    from benchmarks import kernels
    from benchmarks.launching import launch_together, python_module
    from testing.launch import mpiexec_command, mpiexec_env

    launches = []
    for engine in kernels.ENGINES:
        rows, error = launch_together(
            [
                (
                    [*mpiexec_command(2), *python_module("benchmarks.kernels", "--overhead")],
                    {**mpiexec_env(2), "MPI_STRATEGY_KERNELS": engine},
                )
            ]
        )
        assert error is None, error
        assert {r["engine"] for r in rows} == {engine} and len(rows) == 2, rows
        launches.append({"kind": "overhead", "engine": engine, "rows": rows})
    summary = kernels.summary(launches)
    assert summary["collective_us"]["native"] < summary["collective_us"]["python"]
    compute = {
        m: {"params": 1000 * (i + 1), "ms_per_step": 5.0 * (i + 1)}
        for i, m in enumerate(["lenet3", "cnn", "higgs"])
    }
    model = kernels.projection(launches, compute)
    assert len(model["paper"]) == 6 and all(r["native_speedup"] > 0 for r in model["paper"])
    assert all(
        r["native_agreement_share_at_4096"] < r["native_gathered_agreement_share_at_4096"]
        for r in model["paper"]
    )
    assert "| Higgs DNN | 10GbE | 80 |" in "\n".join(kernels.cost_markdown(model))


@pytest.mark.single_process
def test_a_run_writes_files_git_tracks_only_when_asked(monkeypatch):
    import subprocess

    from benchmarks import __main__ as driver
    from mpi_testing import REPO

    out_dir, img_dir, docs_page = driver.destinations(driver.parser().parse_args([]))
    assert docs_page is None
    # By default every file lands where git ignores it (benchmarks/results/).
    for path in (os.path.join(out_dir, "latest.json"), os.path.join(img_dir, "scaling.png")):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, check=False)
        assert ignored.returncode == 0, f"a default run would write {path}, which git tracks"
    _, img_dir, docs_page = driver.destinations(driver.parser().parse_args(["--update-docs"]))
    assert img_dir == os.path.join(REPO, "docs", "img")
    assert docs_page == os.path.join(REPO, "docs", "benchmarks.md")
    # A quick run never rewrites the docs: refused before anything is launched.
    monkeypatch.setattr("sys.argv", ["benchmarks", "--update-docs", "--quick"])
    with pytest.raises(SystemExit) as refused:
        driver.main()
    assert refused.value.code == 2


@pytest.mark.single_process
def test_help_sets_the_maintainers_tools_apart_and_the_report_names_the_engine():
    from benchmarks import __main__ as driver

    text = driver.parser().format_help()
    users, _, maintainers = text.partition("maintainers' options:")
    listed = [line.split()[0] for line in users.splitlines() if line.startswith("  --")]
    assert listed == ["--ranks", "--quick", "--out-dir", "--elastic", "--kernels"], text
    for tool in ("--update-docs", "--links", "benchmarks.against", "benchmarks.timeline_view"):
        assert tool in maintainers, f"{tool} is not among the maintainers' tools:\n{text}"

    # What the report's first line names (test_one_tiny_training_variant_end_to_end).
    assert driver.engine_in_use(1) in ("native", "python")
