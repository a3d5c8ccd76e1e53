"""The central promise of distribute/strategy.py: N ranks train exactly like
MirroredStrategy on N devices.

Each rank trains the same small Keras model twice from identical initial
weights on identical data with the same global batch: once with MPIStrategy
across the ranks, once with tf.distribute.MirroredStrategy over as many
logical CPU devices in this process. Per-step losses and final weights must
agree to float rounding (1e-5), in eager and tf.function custom loops, with
experimental_distribute_dataset and experimental_distribute_values_from_function,
including a ragged last batch.
"""

import numpy as np
import pytest
import tensorflow as tf

from mpi_testing import (
    NUM_REPLICAS,
    assert_same_on_all_ranks,
    computed_on_rank0,
    mpi_strategy_under_test,
    reference_strategy,
)

PER_REPLICA_BATCH = 4
GLOBAL_BATCH = PER_REPLICA_BATCH * NUM_REPLICAS
NUM_EXAMPLES = GLOBAL_BATCH * 2 + GLOBAL_BATCH // 2 + 1  # ragged last batch
BATCHES = 3  # two full, one of GLOBAL_BATCH // 2 + 1 examples
FEATURES, CLASSES = 8, 3

_rng = np.random.default_rng(0)
X = _rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype(np.float32)
Y = _rng.integers(0, CLASSES, size=NUM_EXAMPLES).astype(np.int64)
INITIAL_WEIGHTS = [
    _rng.normal(scale=0.3, size=(FEATURES, 16)).astype(np.float32),
    np.zeros(16, np.float32),
    _rng.normal(scale=0.3, size=(16, CLASSES)).astype(np.float32),
    np.zeros(CLASSES, np.float32),
]


@pytest.fixture(scope="module")
def strategies():
    return {"mpi": mpi_strategy_under_test(), "mirrored": reference_strategy()}


def build(strategy):
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input((FEATURES,)),
                tf.keras.layers.Dense(16, activation="relu"),
                tf.keras.layers.Dense(CLASSES),
            ]
        )
        model.set_weights(INITIAL_WEIGHTS)
        optimizer = tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    return model, optimizer


def distributed_batches(strategy, input_mode):
    if input_mode == "dataset":
        dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
        return list(strategy.experimental_distribute_dataset(dataset))
    batches = []
    for start in range(0, NUM_EXAMPLES, GLOBAL_BATCH):
        # The last batch is ragged: fewer examples per replica, none on some.
        def value_fn(ctx, start=start):
            lo = start + ctx.replica_id_in_sync_group * PER_REPLICA_BATCH
            return X[lo : lo + PER_REPLICA_BATCH], Y[lo : lo + PER_REPLICA_BATCH]

        batches.append(strategy.experimental_distribute_values_from_function(value_fn))
    return batches


def train(strategy, mode, input_mode):
    model, optimizer = build(strategy)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def step(batch):
        per_replica_loss = strategy.run(replica_step, args=batch)
        return strategy.reduce("SUM", per_replica_loss, axis=None)

    if mode == "function":
        step = tf.function(step)
    losses = [float(step(batch)) for batch in distributed_batches(strategy, input_mode)]
    return np.array(losses), list(model.get_weights())


@pytest.mark.parametrize("input_mode", ["dataset", "values_from_function"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_training_matches_mirrored_strategy(strategies, mode, input_mode):
    mpi_losses, mpi_weights = train(strategies["mpi"], mode, input_mode)
    ref_losses, ref_weights = computed_on_rank0(
        lambda: train(strategies["mirrored"], mode, input_mode)
    )
    assert len(mpi_losses) == BATCHES  # the ragged last batch included
    np.testing.assert_allclose(mpi_losses, ref_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(mpi_weights, ref_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The weights moved: a test that trains nothing would pass trivially.
    assert not np.allclose(mpi_weights[0], INITIAL_WEIGHTS[0], atol=1e-4)
    for w in mpi_weights:
        assert_same_on_all_ranks(w, "trained weight")
