"""Where a training step's time goes, from an MPIStrategy timeline (``MPI_STRATEGY_TIMELINE``).

    MPI_STRATEGY_TIMELINE=t.json mpiexec -n 2 python -m benchmarks.train_step higgs_small mpi
    python -m benchmarks.timeline_view t.json t.png      # merge, summarize, draw 3 steps

``summary`` splits each rank's time between its first and last collective into
waiting for the other ranks, transferring, and outside collectives (the
model's compute and TensorFlow's own per-step work); ``plot`` draws a few
steps, one row per rank.
"""

import itertools
import os
import sys

from mpi_strategy import timeline

PARTS = ("wait for ranks", "transfer")


def _collectives(events, rank):
    """Rank ``rank``'s collectives in time order: (start, end, wait, transfer, name) in us."""
    spans = sorted(
        (e for e in events if e.get("ph") == "X" and e["pid"] == rank),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    out = []
    for e in spans:
        if e["name"] not in PARTS:
            out.append([e["ts"], e["ts"] + e["dur"], 0.0, 0.0, e["name"]])
        elif out:
            out[-1][2 if e["name"] == PARTS[0] else 3] = e["dur"]
    return out


def summary(events):
    """Per rank, the median step (from one collective of the most frequent kind
    to the next) split into milliseconds waiting for the other ranks,
    transferring, and outside collectives; and collectives per step."""
    import numpy as np

    rows = []
    for rank in sorted({e["pid"] for e in events if e.get("ph") == "X"}):
        spans = _collectives(events, rank)
        names = [s[4] for s in spans]
        kind = max(set(names), key=names.count)
        starts = [s[0] for s in spans if s[4] == kind]
        if len(starts) < 3:
            continue
        steps = []
        for begin, end in itertools.pairwise(starts):
            inside = [s for s in spans if begin <= s[0] < end]
            wait, transfer = sum(s[2] for s in inside), sum(s[3] for s in inside)
            steps.append((end - begin, wait, transfer, end - begin - wait - transfer, len(inside)))
        med = np.median(np.array(steps), axis=0)
        med = [float(v) for v in med]
        rows.append(
            {
                "rank": rank,
                "collectives_per_step": med[4],
                "step_ms": med[0] / 1e3,
                "wait_ms": med[1] / 1e3,
                "transfer_ms": med[2] / 1e3,
                "outside_ms": med[3] / 1e3,
            }
        )
    return rows


def plot(events, png_path, title, steps=3):
    """Draws ``steps`` steps from the middle of the trace, one row per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    first = _collectives(events, ranks[0])
    middle = len(first) // 2
    rows = summary(events)
    per_step = max(1, round(rows[0]["collectives_per_step"])) if rows else 1
    t0 = first[middle][0]
    t1 = first[min(len(first) - 1, middle + steps * per_step)][0]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(ranks)))
    for row, rank in enumerate(ranks):
        ax.broken_barh([(0, (t1 - t0) / 1e3)], (row - 0.3, 0.6), color="#dddddd")
        for start, _, wait, transfer, _ in _collectives(events, rank):
            if t0 - 1e3 <= start <= t1:
                ax.broken_barh(
                    [((start - t0) / 1e3, wait / 1e3)], (row - 0.3, 0.6), color="#f28e2b"
                )
                ax.broken_barh(
                    [((start + wait - t0) / 1e3, transfer / 1e3)], (row - 0.3, 0.6), color="#4e79a7"
                )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#dddddd", "#f28e2b", "#4e79a7")]
    ax.legend(
        handles,
        ["outside collectives (compute, TF)", "wait for ranks", "transfer"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.45),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    trace, png = argv[0], argv[1] if len(argv) > 1 else None
    events = timeline.read_events(timeline.merge(trace))
    for row in summary(events):
        print(row)
    if png:
        print(plot(events, png, os.path.basename(trace)))


if __name__ == "__main__":
    main()
