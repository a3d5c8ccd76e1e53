"""Keras 3 optimizer features that synchronize replicas inside a tf.cond, under MPIStrategy
(distribute/strategy.py: a replica that synchronizes without merge_call).

``gradient_accumulation_steps`` applies the all-reduced gradients in one branch
of a ``tf.cond`` every k-th step; ``use_ema`` with ``ema_overwrite_frequency``
overwrites the weights in one; merge_call cannot run there (it fails under every
tf.distribute strategy). With one device per rank, MPIStrategy synchronizes
there without merge_call, and ``fit`` on N ranks gives the per-epoch losses,
final weights (the EMA weights with ``use_ema``) and step count of ONE process
without a strategy at the same global batch (within 1e-4; 1e-3 with float16
layers), identical on every rank. With several devices per rank these features
raise MPIStrategyError ("one device per rank") on every rank; plain ``use_ema``
works there too.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy import MPIStrategyError
from mpi_testing import LOCAL_DEVICES, NUM_REPLICAS, assert_same_on_all_ranks, computed_on_rank0

FEATURES, CLASSES = 6, 4
BATCH = 4 * NUM_REPLICAS  # the global batch, the same in the one-process reference
EXAMPLES = 8 * BATCH  # no ragged batch: a ragged one is averaged differently
EPOCHS = 3

_rng = np.random.default_rng(5)
X = _rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
Y = _rng.integers(0, CLASSES, EXAMPLES).astype(np.int64)

# id: (Adam keyword arguments, steps_per_execution, dtype policy)
CASES = {
    "accumulate2": (dict(gradient_accumulation_steps=2), 1, None),
    "accumulate4-steps_per_execution3": (dict(gradient_accumulation_steps=4), 3, None),
    "ema": (dict(use_ema=True), 1, None),
    "ema-overwrite3": (dict(use_ema=True, ema_overwrite_frequency=3), 1, None),
    "accumulate2-ema": (dict(gradient_accumulation_steps=2, use_ema=True), 1, None),
    # LossScaleOptimizer's own tf.cond around the accumulating inner optimizer.
    "accumulate2-mixed_float16": (dict(gradient_accumulation_steps=2), 1, "mixed_float16"),
}


def _synchronizes_in_cond(adam_kwargs):
    return bool(
        adam_kwargs.get("gradient_accumulation_steps") or adam_kwargs.get("ema_overwrite_frequency")
    )


def _model():
    """A small MLP with fixed weights, its logits in float32 under any policy."""
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(CLASSES, dtype="float32"),
        ]
    )
    model.set_weights(
        [
            np.sin(np.arange(w.size) + 1.0).reshape(w.shape).astype(np.float32) * 0.3
            for w in model.get_weights()
        ]
    )
    return model


def fit(strategy, adam_kwargs, steps_per_execution, policy):
    """Per-epoch losses, final weights and optimizer step count of a short ``fit``
    (``strategy`` None: one process, no strategy)."""
    keras.mixed_precision.set_global_policy(policy or "float32")
    try:
        with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
            model = _model()
            optimizer = keras.optimizers.Adam(learning_rate=0.02, **adam_kwargs)
            if policy:
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            model.compile(
                optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution,
            )
        history = model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    averages = [v.numpy() for v in inner.variables if v.name.endswith("_average")]
    return (
        np.array(history.history["loss"]),
        model.get_weights(),
        int(inner.iterations.numpy()),
        averages,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_fit_matches_one_process_without_strategy(strategy, case):
    adam_kwargs, steps_per_execution, policy = CASES[case]
    if LOCAL_DEVICES > 1 and _synchronizes_in_cond(adam_kwargs):
        with pytest.raises(MPIStrategyError, match="one device per rank"):
            fit(strategy, adam_kwargs, steps_per_execution, policy)
        return
    losses, weights, iterations, averages = fit(strategy, adam_kwargs, steps_per_execution, policy)
    want = computed_on_rank0(lambda: fit(None, adam_kwargs, steps_per_execution, policy))
    # float16 layers round differently on smaller per-replica batches.
    tol = 1e-3 if policy else 1e-4
    np.testing.assert_allclose(losses, want[0], rtol=tol, atol=tol, err_msg="losses")
    assert_same_on_all_ranks(losses, "losses")
    assert len(weights) == len(want[1])
    for i, (w, ref) in enumerate(zip(weights, want[1])):
        np.testing.assert_allclose(w, ref, rtol=tol, atol=tol, err_msg=f"weight {i}")
        assert_same_on_all_ranks(w, f"weight {i}")
    steps = EPOCHS * EXAMPLES // BATCH
    assert iterations == want[2] == steps // adam_kwargs.get("gradient_accumulation_steps", 1)
    if adam_kwargs.get("use_ema"):
        # fit ends by swapping the moving averages into the model.
        assert len(averages) == len(weights)
        for w, average in zip(weights, averages):
            np.testing.assert_array_equal(w, average)
    assert losses[-1] < losses[0]


def _fit_with_loss_scaling(strategy, x):
    """Weights, the optimizer's steps applied and its loss scale after one
    epoch of ``fit`` under mixed_float16 with a LossScaleOptimizer."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
            model = _model()
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
            model.compile(
                optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        model.fit(x, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizer = model.optimizer
    return (
        model.get_weights(),
        int(optimizer.inner_optimizer.iterations.numpy()),
        float(optimizer.dynamic_scale.numpy()),
    )


def test_loss_scaling_skips_a_step_that_overflows_on_one_replica_on_every_rank(strategy):
    """One example of the first batch too large for float16, in the last
    replica's share: that step is skipped and the loss scale halved on every
    rank, as one process does on the global batch. (Keras asks each process's
    first replica whether the gradients are finite: ranks would part ways.)"""
    x = X.copy()
    x[BATCH - 1] = 1e5  # inf in float16
    weights, applied, scale = _fit_with_loss_scaling(strategy, x)
    want = computed_on_rank0(lambda: _fit_with_loss_scaling(None, x))
    assert (applied, scale) == want[1:] == (EXAMPLES // BATCH - 1, 2.0**14)
    for i, (w, ref) in enumerate(zip(weights, want[0])):
        assert np.all(np.isfinite(w)), f"weight {i}"
        np.testing.assert_allclose(w, ref, rtol=1e-3, atol=1e-3, err_msg=f"weight {i}")
        assert_same_on_all_ranks(w, f"weight {i}")


def test_all_reduce_inside_tf_cond_of_a_replica_function(strategy):
    """The tf.distribute mechanism underneath: ReplicaContext.all_reduce inside a
    tf.cond of the function given to ``strategy.run``."""

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        mine = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0
        return tf.cond(mine > 0.0, lambda: ctx.all_reduce("SUM", mine), lambda: -mine)

    @tf.function(autograph=False)  # (autograph would turn the error into a StagingError)
    def step():
        return strategy.run(replica_fn)

    if LOCAL_DEVICES > 1:
        with pytest.raises(MPIStrategyError, match="one device per rank"):
            step()
        return
    (got,) = strategy.experimental_local_results(step())
    assert float(got) == NUM_REPLICAS * (NUM_REPLICAS + 1) / 2
