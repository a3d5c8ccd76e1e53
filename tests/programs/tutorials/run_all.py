"""Runs tutorial programs one after another in this process, each in a fresh
subdirectory of WORKDIR that is also its current directory and argv[1].

    python run_all.py --keras keras3|tf_keras WORKDIR [NAME ...]
    mpiexec -n N python run_all.py --keras ... WORKDIR   (TUTORIAL_STRATEGY=mpi)

NAME defaults to every tutorial written for that Keras (one process has one
``tf.keras``; see _tutorial.py). For each tutorial, every rank writes
WORKDIR/results/NAME.rank<R>.json: ``ok``, the ``error`` (traceback) if it
raised, the ``numbers`` it reported and its ``seconds``, and prints a summary
line. An exception ends that tutorial only. The ranks then wait for each other:
as long as it takes, unless this rank's tutorial raised. Then the others may
be stuck in a collective this rank will never join, so after
``TUTORIAL_SYNC_TIMEOUT`` seconds (default 20) it aborts the job; the result
files say which tutorials finished. (A rank that is merely slow is never cut
short; a launch in which every rank waits is ended by its caller's silence
limit.)
Run by tests/integration/test_tutorials.py.
"""

import argparse
import json
import os
import runpy
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

# Each tutorial program and the Keras its calls are written for.
TUTORIALS = {
    "keras_tutorial": "keras3",
    "custom_training_tutorial": "tf_keras",
    "save_and_load_tutorial": "tf_keras",
    "multi_worker_with_keras_tutorial": "tf_keras",
    "multi_worker_with_ctl_tutorial": "tf_keras",
    "input_tutorial": "keras3",
    "distributed_training_guide": "keras3",
    "keras_guide_custom_training_loop": "keras3",
    "keras_guide_custom_train_step": "keras3",
    "keras_guide_callbacks": "keras3",
    "keras_guide_transfer_learning": "keras3",
    "keras_guide_subclassing": "keras3",
    "keras_guide_built_in_methods": "keras3",
    "keras_guide_distributed_training": "keras3",
    "checkpoint_guide": "tf_keras",
    "summary_custom_loop_guide": "tf_keras",
    "data_guide": "keras3",
    "keras_tuner_distributed": "keras3",
    "keras_hub_data_parallel": "keras3",
    "tfrs_diststrat_retrieval": "tf_keras",
}

# The programs that also run at 3 ranks and at 2 ranks x 2 devices (the other
# shapes of tests/launchers/test_under_mpiexec.py), where a replica's share of a
# batch and the order of a sum change: tf_keras's custom loops, summaries one
# rank writes, a checkpointed iterator (CI time: the rest at 2 ranks only).
# TensorFlow Recommenders' retrieval ranks near-equal scores in its first
# epoch's top-k accuracies: at 2 x 2 another association of the sum's rounding
# reorders them (CI saw top-50 0.100 against 0.031). Keras 3's fit under any
# strategy fails on the first batch if it does not split evenly (so do input_tutorial,
# keras_guide_custom_train_step, multi_worker_with_ctl_tutorial at 3 replicas
# under MirroredStrategy too, and keras_guide_subclassing's fit on 2 examples
# at 4), and MirroredStrategy over 4 devices takes minutes for Keras 3's guides.
AT_OTHER_SHAPES = (
    "custom_training_tutorial",
    "checkpoint_guide",
    "summary_custom_loop_guide",
)

# The programs that also run under MPIStrategy(shard="gradients") at 2 ranks
# (ZeRO stage 2, whose sums there are the unsharded ones): Keras 3 fit with
# Adam and RMSprop, callbacks, ModelCheckpoint, and saves loaded back in and
# out of a strategy; tf_keras's tf.saved_model.save and load, .keras saves and
# tf.train.CheckpointManager (about 30 s of CI time).
SHARDED = (
    "keras_tutorial",
    "keras_guide_distributed_training",
    "keras_guide_callbacks",
    "save_and_load_tutorial",
    "checkpoint_guide",
)

# Each program's deviations from its source beyond the strategy line (its
# docstring says them in full): one line each, with the reason.
DEVIATIONS = {
    "keras_guide_custom_training_loop": "local MNIST (100 of 400 kept for validation, as "
    "10,000 of 60,000); 1, 1, 2 of the loops' 3, 2, 2 epochs; GAN convolutions of 16 filters and "
    "3 steps (CI time); the add_loss step the guide only defines run for an epoch with its own "
    "optimizer (Keras 3 refuses another model's variables); moved onto tf.distribute as TF's "
    "custom-training tutorial does (scope, distributed datasets, compute_average_loss, "
    "strategy.run/reduce)",
    "keras_guide_custom_train_step": "local MNIST for the GAN; 1 of each fit's 3-5 epochs; GAN "
    "convolutions of 16 filters and 4 of 100 batches (CI time); gan.built = True before its fit "
    "(under any strategy Keras 3 builds the model symbolically first and the guide's GAN has no "
    "call(): it fails under MirroredStrategy too)",
    "keras_guide_callbacks": "local MNIST (400/200 examples, the guide limits to 1,000); 5 of 30 "
    "and 7 of 15 epochs; np.inf for the guide's np.Inf (gone in NumPy 2: the guide fails without "
    "a strategy too)",
    "keras_guide_transfer_learning": "Xception's ImageNet weights cannot be downloaded: a small "
    "local conv base with BatchNormalization; 96 synthetic images of various sizes for "
    "cats_vs_dogs; 2 of 20 and 10 epochs; no matplotlib figures",
    "keras_guide_subclassing": "local MNIST (400 examples); 1 of the VAE's 2 epochs; keras for "
    "keras_core (its name before Keras 3); Sampling draws from its own SeedGenerator (the guide's "
    "unseeded draw fails in fit under MirroredStrategy too)",
    "keras_guide_built_in_methods": "local MNIST (400/200, 100 kept for validation); 1 epoch per "
    "fit (4 for EarlyStopping); steps_per_epoch, validation_steps, save_freq by steps(); "
    "make_or_restore_model once more to read the checkpoints back; LogisticEndpoint fit on 4 "
    "examples, not 3 (Keras' symbolic build under any strategy fails on replica parts of 2 and 1); "
    "no PyTorch DataLoader (not installed) and no plot_model (needs pydot); three repeats of "
    "a fit left out for CI time (with validation_steps, a PyDataset with workers=4, the "
    "multi-input model's dicts)",
    "keras_guide_distributed_training": "local MNIST (400/200, 100 kept for validation); 1 of "
    "the first fit's 2 epochs",
    "checkpoint_guide": "model and optimizer in strategy.scope(), each step by strategy.run "
    "(the guide has no strategy); the checkpointed iterator is the dataset's (a distributed "
    "iterator is not trackable under MirroredStrategy either); the Estimator section left "
    "out (tf.estimator is gone from TF 2.16)",
    "summary_custom_loop_guide": "local MNIST; 2 of 5 epochs per section; models, optimizer, "
    "metrics in strategy.scope(), distributed datasets, steps by strategy.run in tf.function, "
    "loss with reduction NONE and compute_average_loss (a Keras 2 loss with the default "
    "reduction raises inside strategy.run); a fixed <time> in the log directories' names",
    "data_guide": "local Fashion-MNIST; the model in strategy.scope(); 2 of 20 and 10 steps; "
    "./my_ckpt for /tmp/my_ckpt (shared by every run on the machine); only the sections "
    "Iterator Checkpointing and tf.keras",
    "keras_tuner_distributed": "local MNIST (400/200); 25 of 600 steps per epoch and 5 of 100 "
    "validation steps (batches of 16 and 20: Keras 3.15's fit under any strategy fails on a "
    "first batch that does not split evenly, as the guide's validation batch of 1 does under "
    "MirroredStrategy too); AveragePooling2D(pool_size=2) (without it Keras 3.15 raises, under "
    "MirroredStrategy too)",
    "keras_hub_data_parallel": "a tiny BertBackbone config (vocabulary 200, 2 layers, hidden "
    "16) for from_preset (no download here); synthetic preprocessed token sequences for "
    "wikitext-2; the padding mask int32, not bool (Keras 3.15's fit under any strategy "
    "first reduces the first batch, which fails for bool, under MirroredStrategy too); 2 of 3 "
    "epochs",
    "tfrs_diststrat_retrieval": "synthetic MovieLens ratings (400 ratings of 200 movies by 50 "
    "users, split 320/80) for tfds.load (no download here)",
}


# What MPIStrategy does differently from MirroredStrategy, each found by a
# program here and documented in docs/troubleshooting.md ("Behaviour that is
# not an error"); as MultiWorkerMirroredStrategy does too.
_RANDOM_OPS = (
    "random ops that take their seeds from the graph (tf.random without a seed, tf_keras's "
    "Dropout) draw MirroredStrategy's first replica's numbers on every rank"
)
_OWN_COPY = (
    "a variable each replica updates on its own (aggregation NONE: Keras 3 BatchNormalization's "
    "moving statistics) reads as the rank's own copy on rank r, as replica r's"
)
# Numbers not compared with MirroredStrategy's: {program: (paths in its report
# (prefixes, as test_tutorials.differences names them), why)}. Their keys, the
# lengths of their lists (every event, every epoch) and their agreement across
# ranks are still compared; so is the rest of the report.
NOT_AS_MIRRORED = {
    "keras_guide_custom_training_loop": ((".gan_losses", ".generator_weights"), _RANDOM_OPS),
    "summary_custom_loop_guide": (
        (".fit", ".gradient_tape_events", ".printed", ".weights"),
        _RANDOM_OPS + " (every number its Dropout model trains; with Dropout(0.0) all agree)",
    ),
    "keras_tuner_distributed": (
        (".best_model_weights[1]", ".best_model_weights[4]"),
        "a convolution's bias before a BatchNormalization: its gradient is rounding noise, which "
        "Adam scales to full steps (0.3% apart here); its BatchNormalization's moving mean follows",
    ),
    "tfrs_diststrat_retrieval": (
        (".fit.factorized_top_k",),
        "FactorizedTopK scores the candidates of movies.batch(128).map(movie_model), a dataset "
        "made outside the step whose map reads the embedding the step updates; TensorFlow orders "
        "nothing between that run and the update, and which comes first is timing "
        "(MirroredStrategy's update came first in every run tried; MPIStrategy's, which waits for "
        "the all-reduce, in 3 runs of 4: docs/troubleshooting.md); its losses, weights and "
        "evaluate are compared",
    ),
}
# Numbers compared with MirroredStrategy's on rank 0 only (rank r reports its own).
OWN_ON_EACH_RANK = {
    "keras_guide_transfer_learning": (
        # (its two BatchNormalizations' moving means and variances)
        tuple(f".fine_tuned_weights[{i}]" for i in (4, 5, 10, 11)),
        _OWN_COPY,
    ),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--keras", choices=["keras3", "tf_keras"], required=True)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    names = args.names or [n for n, k in TUTORIALS.items() if k == args.keras]
    for name in names:
        if TUTORIALS.get(name) != args.keras:
            parser.error(f"{name} is not a tutorial written for {args.keras}")

    # Before TensorFlow loads Keras: the Keras of this process.
    os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.keras == "tf_keras" else "0"
    sys.path.insert(0, HERE)
    import _tutorial

    launched = time.monotonic()
    workdir = os.path.abspath(args.workdir)
    results = os.path.join(workdir, "results")
    os.makedirs(results, exist_ok=True)
    sync = _Sync(float(os.environ.get("TUTORIAL_SYNC_TIMEOUT", "20")))
    home, argv = os.getcwd(), list(sys.argv)
    for name in names:
        path = os.path.join(HERE, name + ".py")
        where = os.path.join(workdir, name)
        os.makedirs(where, exist_ok=True)
        sync.wait(name, "start")
        start, error = time.monotonic(), None
        os.chdir(where)
        sys.argv = [path, where]
        try:
            runpy.run_path(path, run_name="__main__")
        except (Exception, SystemExit):  # noqa: BLE001 - reported, the next tutorial runs
            error = traceback.format_exc()
        finally:
            os.chdir(home)
            sys.argv = argv
        numbers = _tutorial.LAST_REPORT
        if error is None and numbers is None:
            error = "the program ended without report(...)"
        result = {
            "tutorial": name,
            "strategy": _tutorial.STRATEGY,
            "keras": args.keras,
            "rank": _tutorial.RANK,
            "ok": error is None,
            "error": error,
            "numbers": numbers,
            "seconds": round(time.monotonic() - start, 2),
        }
        with open(os.path.join(results, f"{name}.rank{_tutorial.RANK}.json"), "w") as f:
            json.dump(result, f)
        last = error.strip().splitlines()[-1] if error else "ok"
        print(
            f"TUTORIAL {name} [{_tutorial.STRATEGY}, rank {_tutorial.RANK}]: "
            f"{last} ({result['seconds']} s; {time.monotonic() - launched:.1f} s since "
            "the driver started)",
            flush=True,
        )
        sync.wait(name, "end", failed=error is not None)
    print(
        f"TUTORIALS DONE [{_tutorial.STRATEGY}, rank {_tutorial.RANK}] "
        f"{time.monotonic() - launched:.1f} s after the driver started",
        flush=True,
    )


class _Sync:
    """All ranks meet here. A rank whose tutorial failed ends the job if the
    others do not come within ``timeout`` seconds: they are stuck in a
    collective it left."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.comm = None
        if os.environ.get("TUTORIAL_STRATEGY") == "mpi":
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_size() > 1:
                self.comm = MPI.COMM_WORLD.Dup()  # apart from every strategy's messages

    def wait(self, name, where, failed=False):
        if self.comm is None:
            return
        request = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout
        while not request.Test():
            if failed and time.monotonic() > deadline:
                print(
                    f"TUTORIAL {name}: rank {self.comm.Get_rank()} failed it and waited "
                    f"{self.timeout:g} s at its {where} for the other ranks (stuck in a "
                    "collective this rank left); aborting the job",
                    flush=True,
                )
                sys.stderr.flush()
                from mpi4py import MPI

                MPI.COMM_WORLD.Abort(3)
            time.sleep(0.01)


if __name__ == "__main__":
    main()
