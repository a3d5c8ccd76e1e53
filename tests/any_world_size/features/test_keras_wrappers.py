"""features/keras_wrappers.py: Keras fit / evaluate / predict and callbacks under
MPIStrategy (Keras 3 and tf_keras).

N ranks give the history, evaluation, predictions and weights of Keras under
MirroredStrategy on N devices (within 1e-4), identical on every rank; output
and files come from rank 0 only.
"""

import importlib
import os

import numpy as np
import pytest
import tensorflow as tf

from mpi_testing import (
    NUM_REPLICAS,
    RANK,
    assert_same_on_all_ranks,
    computed_on_rank0,
    reference_strategy,
)

KERASES = ["keras", "tf_keras"]
FEATURES, CLASSES = 6, 4
# Keras reduces the first batch element-wise to build the model, which needs
# equal pieces per replica (MirroredStrategy fails otherwise too); the last
# batch is ragged.
BATCH = 4 * NUM_REPLICAS
EXAMPLES = 3 * BATCH + BATCH // 2 + 1

_rng = np.random.default_rng(3)
X = _rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
Y = _rng.integers(0, CLASSES, EXAMPLES).astype(np.int64)
X_VAL, Y_VAL = X[: BATCH + 5], Y[: BATCH + 5]  # first batch full, last one ragged


@pytest.fixture(scope="module", params=KERASES)
def K(request):
    return importlib.import_module(request.param)


def build(K, strategy, steps_per_execution=1):
    with strategy.scope():
        model = K.Sequential(
            [
                K.Input((FEATURES,)),
                K.layers.Dense(16, activation="relu"),
                K.layers.Dense(CLASSES, dtype="float32"),  # (mixed precision's outputs)
            ]
        )
        model.set_weights(
            [
                np.sin(np.arange(w.size) + 1.0).reshape(w.shape).astype(np.float32) * 0.3
                for w in model.get_weights()
            ]
        )
        model.compile(
            optimizer=K.optimizers.SGD(learning_rate=0.05, momentum=0.9),
            loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy", K.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")],
            steps_per_execution=steps_per_execution,
        )
    return model


def fit_evaluate_predict(K, strategy, input_kind, steps_per_execution, steps_per_epoch, policy):
    K.mixed_precision.set_global_policy(policy)  # (mixed_float16: a LossScaleOptimizer)
    try:
        return _fit_evaluate_predict(K, strategy, input_kind, steps_per_execution, steps_per_epoch)
    finally:
        K.mixed_precision.set_global_policy("float32")


def _fit_evaluate_predict(K, strategy, input_kind, steps_per_execution, steps_per_epoch):
    model = build(K, strategy, steps_per_execution)
    if input_kind == "numpy":
        train = dict(x=X, y=Y, batch_size=BATCH, shuffle=False)
        val = (X_VAL, Y_VAL)
    else:
        train = dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).repeat())
        val = tf.data.Dataset.from_tensor_slices((X_VAL, Y_VAL)).batch(BATCH)
    history = model.fit(
        **train, epochs=2, steps_per_epoch=steps_per_epoch, validation_data=val, verbose=0
    ).history
    evaluation = model.evaluate(X, Y, batch_size=BATCH, verbose=0)
    predictions = model.predict(X, batch_size=BATCH, verbose=0)
    return history, np.array(evaluation), predictions, model.get_weights()


@pytest.mark.parametrize(
    "input_kind,steps_per_execution,steps_per_epoch,policy",
    [
        ("numpy", 1, None, "float32"),  # ragged last batch every epoch
        # steps_per_execution > 1, steps_per_epoch on a repeated dataset; mixed
        # precision (compile wraps the optimizer in a LossScaleOptimizer)
        ("dataset", 3, 5, "mixed_float16"),
    ],
)
def test_fit_evaluate_predict_match_mirrored(
    K, strategy, input_kind, steps_per_execution, steps_per_epoch, policy
):
    args = (input_kind, steps_per_execution, steps_per_epoch, policy)
    got = fit_evaluate_predict(K, strategy, *args)
    want = computed_on_rank0(lambda: fit_evaluate_predict(K, reference_strategy(), *args))
    history, evaluation, predictions, weights = got
    assert set(history) == set(want[0]) and "val_top2" in history
    for key in history:
        np.testing.assert_allclose(history[key], want[0][key], rtol=1e-4, atol=1e-5, err_msg=key)
        assert_same_on_all_ranks(np.array(history[key]), key)
    np.testing.assert_allclose(evaluation, want[1], rtol=1e-4, atol=1e-5)
    # predict: every row, in input order, on every rank.
    assert predictions.shape == (EXAMPLES, CLASSES)
    np.testing.assert_allclose(predictions, want[2], rtol=1e-4, atol=1e-5)
    assert_same_on_all_ranks(predictions, "predictions")
    for w, ref in zip(weights, want[3]):
        np.testing.assert_allclose(w, ref, rtol=1e-4, atol=1e-5)
    assert history["loss"][-1] < history["loss"][0]


def raw_outputs_model(K, strategy, reduction):
    """A model whose train_step and test_step return raw tensors beside a
    metric's result (as many libraries' models do): scalars and a vector,
    float32, float64 and int32, nested."""

    class RawOutputs(K.Model):
        def step(self, data, train):
            x, y = data
            with tf.GradientTape() as tape:
                logits = self(x, training=train)
                per_example = K.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
                loss = tf.reduce_sum(per_example) / BATCH  # over the global batch
            if train:
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            self.accuracy.update_state(y, logits)
            self.rows_seen.update_state(x)
            return {
                "rows_seen": self.rows_seen.result(),
                "loss": loss,
                "rows": tf.shape(x)[0],
                "wide": tf.cast(tf.reduce_max(logits), tf.float64),
                "nested": {"column_means": tf.reduce_mean(logits, axis=0)},
                "accuracy": self.accuracy.result(),
            }

        def train_step(self, data):
            return self.step(data, train=True)

        def test_step(self, data):
            return self.step(data, train=False)

    class RowsSeen(K.metrics.Metric):  # a metric whose result is its variable
        def __init__(self):
            super().__init__(name="rows_seen")
            self.rows = self.add_weight(name="rows", shape=(), initializer="zeros")

        def update_state(self, x):
            self.rows.assign_add(tf.cast(tf.shape(x)[0], tf.float32))

        def result(self):
            return self.rows

    with strategy.scope():
        inputs = K.Input((FEATURES,))
        model = RawOutputs(inputs, K.layers.Dense(CLASSES)(K.layers.Dense(8)(inputs)))
        model.accuracy = K.metrics.SparseCategoricalAccuracy()
        model.rows_seen = RowsSeen()
        model.set_weights(
            [np.cos(np.arange(w.size) + 1.0).reshape(w.shape) * 0.3 for w in model.get_weights()]
        )
        model.compile(optimizer=K.optimizers.SGD(learning_rate=0.1))
    if reduction != "default":
        model.distribute_reduction_method = reduction
    return model


def fit_and_evaluate_raw_outputs(K, strategy, reduction):
    model = raw_outputs_model(K, strategy, reduction)
    seen = []
    record = K.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(_plain(logs))
    )
    history = model.fit(
        X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record]
    ).history
    evaluation = model.evaluate(X_VAL, Y_VAL, batch_size=BATCH, verbose=0, return_dict=True)
    return _plain(history), seen, _plain(evaluation)


def _plain(logs):
    return tf.nest.map_structure(lambda v: np.asarray(v, np.float64), dict(logs))


# Keras 3 reduces a step's outputs with "auto" (its mean); tf_keras with its
# model's distribute_reduction_method ("auto" being its sum).
RAW_OUTPUT_REDUCTIONS = [
    ("keras", "default"),
    ("tf_keras", "default"),  # its "auto": "sum"
    ("tf_keras", "first"),
    ("tf_keras", "concat"),
]


@pytest.mark.parametrize("package,reduction", RAW_OUTPUT_REDUCTIONS)
def test_step_outputs_that_are_not_metrics_reduced_as_mirrored(strategy, package, reduction):
    """fit's history, the logs callbacks see after each batch and evaluate's
    result, for a step returning raw tensors: on every rank what
    MirroredStrategy gives over as many devices (Keras reduces them over the
    local replicas only, unless told the strategy is multi-worker)."""
    K = importlib.import_module(package)
    got = fit_and_evaluate_raw_outputs(K, strategy, reduction)
    want = computed_on_rank0(
        lambda: fit_and_evaluate_raw_outputs(K, reference_strategy(), reduction)
    )
    for what, ours, theirs in zip(("history", "batch logs", "evaluate"), got, want):
        ours_flat, theirs_flat = tf.nest.flatten(ours), tf.nest.flatten(theirs)
        assert len(ours_flat) == len(theirs_flat), (what, ours, theirs)
        for i, (a, b) in enumerate(zip(ours_flat, theirs_flat)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{what} [{i}]")
            assert_same_on_all_ranks(a, f"{what} [{i}]")


def test_output_from_rank0_and_files_written_once(K, strategy, shared_dir, capsys):
    model = build(K, strategy)
    weights = "ckpt.weights.h5" if K.__name__ == "keras" else "ckpt.h5"
    callbacks = [  # the same paths on every rank, as one process would use
        K.callbacks.CSVLogger(os.path.join(shared_dir, "log.csv")),
        K.callbacks.ModelCheckpoint(os.path.join(shared_dir, weights), save_weights_only=True),
        K.callbacks.TensorBoard(os.path.join(shared_dir, "tb")),
        # Runs on every rank and decides the same everywhere (same logs).
        K.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0),
    ]
    history = model.fit(
        X, Y, batch_size=BATCH, epochs=5, shuffle=False, verbose=1, callbacks=callbacks
    )
    printed = capsys.readouterr().out
    if RANK == 0:
        assert "Epoch 1/5" in printed
    else:
        assert "Epoch" not in printed, printed
    # Complete on every rank when fit returns, and written by rank 0 alone.
    assert sorted(os.listdir(shared_dir)) == sorted(["log.csv", weights, "tb"])
    with open(os.path.join(shared_dir, "log.csv")) as f:
        assert len(f.read().splitlines()) == 1 + 2
    events = [f for _, _, files in os.walk(os.path.join(shared_dir, "tb")) for f in files]
    assert len({name.split(".")[-3] for name in events}) == 1, events  # one writer pid
    assert len(history.history["loss"]) == 2  # stopped by EarlyStopping everywhere
    assert_same_on_all_ranks(np.array(len(history.history["loss"])), "epochs run")


class _Interrupt(Exception):
    pass


def test_backup_and_restore_resumes_to_the_uninterrupted_result(K, strategy, shared_dir):
    epochs = 3
    uninterrupted = build(K, strategy)
    uninterrupted.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)

    backup_dir = os.path.join(shared_dir, f"backup-{K.__name__}")

    class InterruptMidEpoch(K.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self._epoch == 1 and batch == 2:
                raise _Interrupt()  # on every rank at the same step, like a job kill

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

    first = build(K, strategy)
    with pytest.raises(_Interrupt):
        first.fit(
            X,
            Y,
            batch_size=BATCH,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[K.callbacks.BackupAndRestore(backup_dir), InterruptMidEpoch()],
        )

    resumed = build(K, strategy)
    history = resumed.fit(
        X,
        Y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[K.callbacks.BackupAndRestore(backup_dir)],
    )
    assert len(history.history["loss"]) == epochs - 1  # epoch 0 was restored
    assert not [f for _, _, files in os.walk(backup_dir) for f in files]  # deleted after fit
    for got, want in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert_same_on_all_ranks(got, "resumed weight")
