"""Horovod's Keras API (mpi_strategy.horovod.tensorflow.keras), at any world size:
horovod/optimizer.py, callbacks.py, sync_batch_norm.py, sync_batch_norm_tf_keras.py, keras.py.

Each rank trains on its slice of every global batch; the oracle is one
process (rank 0) applying the gradients of the concatenated batches. The
callbacks are checked by their effect on what ``fit`` does and logs, and
SyncBatchNormalization against BatchNormalization on the concatenated batch.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import mpi_strategy.horovod.keras as hvd_standalone_keras
import mpi_strategy.horovod.tensorflow as hvd_tf
import mpi_strategy.horovod.tensorflow.keras as hvd
from mpi_strategy._src import _keras_internal
from mpi_strategy._src.horovod import keras as horovod_keras
from mpi_strategy._src.horovod.optimizer import keras_package
from mpi_testing import (
    RANK,
    SIZE,
    assert_same_on_all_ranks,
    computed_on_rank0,
    gather_from_all_ranks,
)

pytestmark = pytest.mark.device_agnostic  # Horovod's API: one process per rank, no strategy

hvd.init()

FEATURES, UNITS, LOCAL, STEPS = 4, 3, 2, 4  # LOCAL rows per rank and step
GLOBAL = SIZE * LOCAL
_rng = np.random.default_rng(11)
X = _rng.normal(size=(STEPS * GLOBAL, FEATURES)).astype(np.float32)
Y = _rng.normal(size=(STEPS * GLOBAL, UNITS)).astype(np.float32)
# Rank r's rows: its LOCAL rows of every global batch, in order.
MINE = [k * GLOBAL + RANK * LOCAL + i for k in range(STEPS) for i in range(LOCAL)]
X_MINE, Y_MINE = X[MINE], Y[MINE]
KERNEL = np.sin(np.arange(FEATURES * UNITS) + 1.0).reshape(FEATURES, UNITS).astype(np.float32)
BIAS = np.cos(np.arange(UNITS)).astype(np.float32) * 0.1


def build(K, optimizer, kernel=KERNEL, bias=BIAS):
    model = K.Sequential([K.Input((FEATURES,)), K.layers.Dense(UNITS)])
    model.set_weights([kernel, bias])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def one_process(lr, momentum, passes, average, steps=STEPS):
    """Weights after ``steps`` global batches in one process, the summed
    gradients of ``passes`` consecutive batches applied together (divided by
    ``passes`` if ``average``)."""
    model = build(keras, keras.optimizers.SGD(lr, momentum=momentum))
    mse = keras.losses.MeanSquaredError()
    summed = None
    for k in range(steps):
        rows = slice(k * GLOBAL, (k + 1) * GLOBAL)
        with tf.GradientTape() as tape:
            loss = mse(Y[rows], model(X[rows]))
        grads = tape.gradient(loss, model.trainable_variables)
        summed = grads if summed is None else [s + g for s, g in zip(summed, grads)]
        if (k + 1) % passes == 0:
            step = [s / passes if average else s for s in summed]
            model.optimizer.apply(step, model.trainable_variables)
            summed = None
    return model.get_weights()


def optimizer_of(kind, lr, momentum):
    if kind == "keras":
        return keras.optimizers.SGD(lr, momentum=momentum)
    if kind == "keras_accumulating":  # Keras 3's own accumulation: the mean of 2 passes
        return keras.optimizers.SGD(lr, momentum=momentum, gradient_accumulation_steps=2)
    if kind == "tf_keras":
        return tf_keras.optimizers.SGD(lr, momentum=momentum)
    return tf_keras.optimizers.legacy.SGD(lr, momentum=momentum)


KINDS = ["keras", "tf_keras", "tf_keras_legacy"]
CASES = {
    # id: (optimizer kind, backward passes, average them, how it trains):
    # "fit"; "loop": an eager tape's gradients to apply_gradients; "compute":
    # Horovod's Keras 2 hooks, _compute_gradients then apply_gradients, in a
    # tf.function (as Horovod's tests and tf_keras's minimize call them).
    "keras-fit": ("keras", 1, False, "fit"),
    "keras-fit-2passes-averaged": ("keras", 2, True, "fit"),
    "keras-fit-4passes": ("keras", 4, False, "fit"),
    "keras-eager-loop-2passes-tf-face": ("keras", 2, False, "loop"),
    # (passes and average: the oracle's; the optimizer has no backward passes)
    "keras-fit-own-gradient-accumulation": ("keras_accumulating", 2, True, "fit"),
    "tf_keras-fit": ("tf_keras", 1, False, "fit"),
    "tf_keras-fit-4passes": ("tf_keras", 4, False, "fit"),
    "tf_keras-fit-2passes-averaged": ("tf_keras", 2, True, "fit"),
    "tf_keras-eager-loop-2passes-averaged": ("tf_keras", 2, True, "loop"),
    "tf_keras-compute-gradients-2passes": ("tf_keras", 2, False, "compute"),
    "tf_keras-legacy-fit-2passes": ("tf_keras_legacy", 2, False, "fit"),
    "tf_keras-legacy-fit-4passes-averaged": ("tf_keras_legacy", 4, True, "fit"),
    "tf_keras-legacy-compute-gradients-4passes-averaged": ("tf_keras_legacy", 4, True, "compute"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_distributed_optimizer_trains_as_one_process_on_the_concatenated_batches(case):
    kind, passes, average, how = CASES[case]
    lr, momentum = 0.1, 0.5
    original = optimizer_of(kind, lr, momentum)
    if kind == "keras_accumulating":
        opt = hvd.DistributedOptimizer(original)
    elif how == "loop":  # horovod.tensorflow's DistributedOptimizer takes Keras optimizers too
        opt = hvd_tf.DistributedOptimizer(
            original, backward_passes_per_step=passes, average_aggregated_gradients=average
        )
    else:
        opt = hvd.DistributedOptimizer(
            original, backward_passes_per_step=passes, average_aggregated_gradients=average
        )
    # A subclass of the optimizer's class, of the same name and config.
    assert isinstance(opt, type(original)) and type(opt) is not type(original)
    assert type(opt).__name__ == type(original).__name__
    assert opt.get_config() == original.get_config()

    K = keras if kind.startswith("keras") else tf_keras
    model = build(K, opt)
    mse = K.losses.MeanSquaredError()

    @tf.function
    def compute_and_apply(xb, yb):
        def loss():
            return mse(yb, model(xb))

        pairs = opt._compute_gradients(loss, var_list=model.trainable_variables)
        opt.apply_gradients(pairs, experimental_aggregate_gradients=False)

    def train(first, last):
        rows = slice(first * LOCAL, last * LOCAL)
        if how == "fit":
            model.fit(X_MINE[rows], Y_MINE[rows], batch_size=LOCAL, shuffle=False, verbose=0)
            return
        for k in range(first, last):
            xb, yb = X_MINE[k * LOCAL : (k + 1) * LOCAL], Y_MINE[k * LOCAL : (k + 1) * LOCAL]
            if how == "compute":
                compute_and_apply(tf.constant(xb), tf.constant(yb))
                continue
            with tf.GradientTape() as tape:
                loss = mse(yb, model(xb))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

    train(0, 1)
    if passes > 1:  # accumulated only: the weights have not moved
        for got, initial in zip(model.get_weights(), [KERNEL, BIAS]):
            np.testing.assert_array_equal(got, initial)
    train(1, STEPS)
    want = computed_on_rank0(lambda: one_process(lr, momentum, passes, average))
    for got, expected in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert_same_on_all_ranks(got, "weights")
    if kind == "keras_accumulating":  # Keras counts its updates
        assert int(opt.iterations.numpy()) == STEPS // passes
        return
    assert int(opt.iterations.numpy()) == STEPS  # (Horovod counts every backward pass)
    if passes > 1:  # Horovod's state: the passes since the last reduction
        assert int(opt._agg_helper.counter.numpy()) == STEPS % passes


def test_saved_optimizer_loads_plain_and_load_model_wraps_it_with_its_state(tmp_path):
    model = build(keras, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5)))
    model.fit(X_MINE, Y_MINE, batch_size=LOCAL, shuffle=False, verbose=0)
    path = str(tmp_path / f"model{RANK}.keras")  # (one file per rank)
    model.save(path)
    saved_state = [v.numpy() for v in model.optimizer.variables]

    plain = keras.models.load_model(path)  # without Horovod: the optimizer's own class
    assert type(plain.optimizer) is keras.optimizers.SGD
    assert plain.optimizer.get_config() == model.optimizer.get_config()

    loaded = hvd.load_model(path)
    opt = loaded.optimizer
    assert isinstance(opt, keras.optimizers.SGD) and type(opt) is not keras.optimizers.SGD
    assert len(opt.variables) == len(saved_state)
    assert [id(v) for v in opt.variables()] == [id(v) for v in opt.variables]  # (as Horovod's)
    for variable, value in zip(opt.variables, saved_state):
        np.testing.assert_array_equal(variable.numpy(), value)
    # It averages: one more step leaves every rank with the same weights.
    loaded.fit(X_MINE[:LOCAL], Y_MINE[:LOCAL], batch_size=LOCAL, verbose=0)
    for weight in loaded.get_weights():
        assert_same_on_all_ranks(weight, "weights after a step of the loaded model")


@pytest.mark.parametrize("K", [keras, tf_keras], ids=lambda K: K.__name__)
def test_partial_distributed_optimizer_keeps_local_layers_gradients_local(K):
    lr = 0.1
    shared, local = K.layers.Dense(UNITS), K.layers.Dense(UNITS)
    model = K.Sequential([K.Input((FEATURES,)), shared, local])
    model.set_weights([KERNEL, BIAS, np.eye(UNITS, dtype=np.float32), BIAS])
    opt = hvd.PartialDistributedOptimizer(K.optimizers.SGD(lr), local_layers=local)
    with tf.GradientTape(persistent=True) as tape:
        loss = K.losses.MeanSquaredError()(Y_MINE, model(X_MINE))
    grads = tape.gradient(loss, model.trainable_variables)
    before = model.get_weights()
    if K is keras:
        opt.apply_gradients(zip(grads, model.trainable_variables))
    else:  # Horovod's Keras 2 way: its _compute_gradients, then apply what it returns
        opt.apply_gradients(opt._compute_gradients(loss, model.trainable_variables, tape=tape))
    for i, (got, was, grad) in enumerate(zip(model.get_weights(), before, grads)):
        if i < 2:  # the shared layer: the average over the ranks
            expected = was - lr * gather_from_all_ranks(grad.numpy()).mean(0)
        else:  # the local layer: its own gradient, divided by the number of ranks
            expected = was - lr * grad.numpy() / SIZE
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def variable_of(kind, value):
    return (keras.Variable if kind == "keras" else tf.Variable)(np.array(value, np.float32))


@pytest.mark.parametrize("average", [False, True], ids=["summed", "averaged"])
@pytest.mark.parametrize("kind", KINDS)
def test_local_variables_keep_their_own_gradients_over_the_backward_passes(kind, average):
    passes, lr, cycles = 2, 0.5, 2
    opt = hvd.DistributedOptimizer(
        optimizer_of(kind, lr, 0.0),
        backward_passes_per_step=passes,
        average_aggregated_gradients=average,
    )
    shared, local = variable_of(kind, [1.0, 2.0]), variable_of(kind, [3.0, 4.0])
    opt.register_local_var(local)
    expected_shared, expected_local = shared.numpy().copy(), local.numpy().copy()
    divisor = passes if average else 1
    for cycle in range(cycles):
        for p in range(passes):
            grad = (RANK + 1.0) * (p + 1 + cycle) * np.array([1.0, -1.0], np.float32)
            opt.apply_gradients([(tf.constant(grad), shared), (tf.constant(grad), local)])
        summed = [(r + 1.0) * sum(p + 1 + cycle for p in range(passes)) for r in range(SIZE)]
        # shared: the mean over the ranks; local: this rank's own, divided by the size
        expected_shared -= lr * np.mean(summed) * np.array([1.0, -1.0]) / divisor
        expected_local -= lr * summed[RANK] / SIZE * np.array([1.0, -1.0]) / divisor
        np.testing.assert_allclose(shared.numpy(), expected_shared, rtol=1e-6)
        np.testing.assert_allclose(local.numpy(), expected_local, rtol=1e-6)
    assert int(opt.iterations.numpy()) == cycles * passes
    assert int(opt._agg_helper.counter.numpy()) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_an_inf_gradient_stays_inf_and_is_gone_after_its_cycle(kind):
    # Horovod: the sums are set to zero after each reduction, so one cycle's
    # inf (here on rank 0 only) reaches the update as inf, not NaN, and the
    # next cycle's gradients are finite. (Checked on the gradients Horovod's
    # _allreduce returns: tf_keras's own SGD keeps an inf in its state.)
    passes, lr = 2, 1.0
    opt = hvd.DistributedOptimizer(
        optimizer_of(kind, lr, 0.0),
        backward_passes_per_step=passes,
        average_aggregated_gradients=True,
        sparse_as_dense=True,
    )
    x = variable_of(kind, [0.0, 0.0])
    first = np.array([np.inf if RANK == 0 else 1.0, 1.0], np.float32)
    cycles = [[first, np.ones(2, np.float32)], [np.ones(2, np.float32)] * passes]
    reduced = []
    for cycle in cycles:
        for grad in cycle:
            grads = opt._allreduce([tf.constant(grad)], [x])
            opt.apply_gradients(zip(grads, [x]))
        reduced.append(grads[0].numpy())
        if len(reduced) == 1:
            assert x.numpy()[0] == -np.inf and x.numpy()[1] == -1.0  # (the mean of 1 and 1)
    np.testing.assert_array_equal(reduced, [[np.inf, 1.0], [1.0, 1.0]])


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_gradients_with_backward_passes_need_sparse_as_dense(kind):
    # An Embedding's gradient is IndexedSlices; summed over passes only as dense (Horovod's rule).
    K = keras if kind == "keras" else tf_keras
    ids = np.array([[RANK % 3, 1], [2, RANK % 2]])

    def model_and_grads():
        model = K.Sequential([K.Input((2,), dtype="int32"), K.layers.Embedding(4, 3)])
        model.set_weights([np.arange(12, dtype=np.float32).reshape(4, 3)])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(ids) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        return model, grads

    model, grads = model_and_grads()
    strict = hvd.DistributedOptimizer(optimizer_of(kind, 0.1, 0.0), backward_passes_per_step=2)
    with pytest.raises(ValueError, match="sparse_as_dense"):
        strict.apply_gradients(zip(grads, model.trainable_variables))
    opt = hvd.DistributedOptimizer(
        optimizer_of(kind, 0.1, 0.0), backward_passes_per_step=2, sparse_as_dense=True
    )
    dense = tf.convert_to_tensor(grads[0]).numpy()
    for _ in range(2):
        opt.apply_gradients(zip(grads, model.trainable_variables))
    everyone = gather_from_all_ranks(dense).mean(0)
    expected = np.arange(12, dtype=np.float32).reshape(4, 3) - 0.1 * 2 * everyone
    np.testing.assert_allclose(model.get_weights()[0], expected, rtol=1e-6)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("kind", ["tf_keras", "tf_keras_legacy"])
def test_keras2_hooks_reduce_once_and_apply_gradients_applies_what_they_return(kind, passes):
    lr = 0.5
    opt = hvd.DistributedOptimizer(optimizer_of(kind, lr, 0.0), backward_passes_per_step=passes)
    assert (opt._agg_helper is None) == (passes == 1)
    shared, local = tf.Variable([1.0, 2.0]), tf.Variable([3.0, 4.0])
    opt.register_local_var(local)
    scale = RANK + 1.0
    mean_scale = np.mean([r + 1.0 for r in range(SIZE)])

    def loss():
        return scale * tf.reduce_sum(shared + 2.0 * local)

    hooks = [
        lambda: opt._compute_gradients(loss, [shared, local]),
        lambda: opt.compute_gradients(loss, [shared, local]),  # (tf_keras's minimize calls it)
    ]
    for hook in hooks:
        before = [shared.numpy(), local.numpy()]
        for p in range(passes):
            pairs = hook()
            assert pairs[0][1] is shared and pairs[1][1] is local
            if p == passes - 1:  # reduced: the mean for shared, this rank's / size for local
                np.testing.assert_allclose(pairs[0][0], passes * mean_scale * np.ones(2))
                np.testing.assert_allclose(pairs[1][0], passes * 2 * scale / SIZE * np.ones(2))
            # Horovod's _aggregate_gradients: the optimizer's own (no strategy: as they are)
            for (g, v), (g2, v2) in zip(pairs, opt._aggregate_gradients(pairs)):
                assert v2 is v
                np.testing.assert_array_equal(g2, g)
            opt.apply_gradients(pairs)
        # Applied once, as they were returned (not reduced a second time).
        np.testing.assert_allclose(shared.numpy(), before[0] - lr * passes * mean_scale, rtol=1e-6)
        np.testing.assert_allclose(
            local.numpy(), before[1] - lr * passes * 2 * scale / SIZE, rtol=1e-6
        )
    if kind == "tf_keras_legacy":  # get_gradients: graph mode (tf.gradients)

        @tf.function
        def graph_gradients():
            return opt.get_gradients(loss(), [shared, local])

        for _ in range(passes):
            got = graph_gradients()
        np.testing.assert_allclose(got[0], passes * mean_scale * np.ones(2))
        np.testing.assert_allclose(got[1], passes * 2 * scale / SIZE * np.ones(2))
    assert int(opt.iterations.numpy()) == 2 * passes


@pytest.mark.parametrize("kind", KINDS)
def test_private_optimizer_methods_overridden_are_listed_in_the_compat_boundary(kind):
    original = optimizer_of(kind, 0.1, 0.0)
    made = type(hvd.DistributedOptimizer(original))
    overridden = {
        name
        for klass in made.__mro__[: made.__mro__.index(type(original))]
        for name in vars(klass)
        if name.startswith("_") and not name.startswith("__") and hasattr(type(original), name)
    }
    listed = {m.name for m in _keras_internal.OVERRIDDEN_METHODS}
    assert overridden <= listed, overridden - listed
    if kind == "tf_keras_legacy":  # (minimize reduces through its _compute_gradients)
        assert "_compute_gradients" in overridden


@pytest.mark.parametrize("K", [keras, tf_keras], ids=lambda K: K.__name__)
def test_broadcast_global_variables_callback_makes_every_rank_start_from_the_root(K):
    kernel = KERNEL + RANK  # every rank starts elsewhere
    bias = BIAS + RANK
    model = build(K, K.optimizers.SGD(0.0), kernel=kernel, bias=bias)  # (lr 0: nothing moves)
    model.optimizer.iterations.assign(10 * RANK)
    local_bias = model.layers[0].bias
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[local_bias])
    assert isinstance(callback, hvd.callbacks.BroadcastGlobalVariablesCallback)
    model.fit(X_MINE, Y_MINE, batch_size=LOCAL, verbose=0, callbacks=[callback])
    assert isinstance(callback, K.callbacks.Callback)  # (built on the model's Keras)
    got_kernel, got_bias = model.get_weights()
    np.testing.assert_array_equal(got_kernel, KERNEL)  # rank 0's
    np.testing.assert_array_equal(got_bias, bias)  # local: this rank's own
    # The optimizer's variables too: rank 0's count after its first step, plus the rest.
    assert int(model.optimizer.iterations.numpy()) == STEPS


@pytest.mark.parametrize("K", [keras, tf_keras], ids=lambda K: K.__name__)
def test_metric_average_callback_logs_the_average_over_the_ranks(K):
    model = build(K, K.optimizers.SGD(0.0))
    local_loss = model.evaluate(X_MINE, Y_MINE, batch_size=LOCAL, verbose=0)
    expected = float(np.mean(gather_from_all_ranks(np.array(local_loss, np.float64))))
    seen = []

    class After(K.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(logs["loss"])

    history = model.fit(
        X_MINE,
        Y_MINE,
        batch_size=LOCAL,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.MetricAverageCallback(), After()],
    )
    np.testing.assert_allclose(history.history["loss"], [expected] * 2, rtol=1e-5)
    np.testing.assert_allclose(seen, [expected] * 2, rtol=1e-5)
    assert_same_on_all_ranks(np.array(history.history["loss"]), "averaged loss")


def warmup_lr(initial, warmup, steps_per_epoch, epoch, batch):
    """Horovod's warmup: initial / size * (e * (size - 1) / warmup + 1),
    e = epoch + (batch + 1) / steps_per_epoch; unchanged after the warmup."""
    if epoch >= warmup:
        return warmup_lr(initial, warmup, steps_per_epoch, warmup - 1, steps_per_epoch - 1)
    e = epoch + (batch + 1) / steps_per_epoch
    return initial / SIZE * (e * (SIZE - 1) / warmup + 1)


@pytest.mark.parametrize("kind", ["keras", "tf_keras_legacy"])
def test_learning_rate_warmup_callback_sets_horovods_rates(kind):
    initial, warmup, momentum, epochs = 0.1, 2, 0.5, 3
    K = keras if kind == "keras" else tf_keras
    model = build(K, optimizer_of(kind, initial, momentum))
    seen = []

    class Record(K.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            optimizer = self.model.optimizer
            seen.append([float(np.asarray(optimizer.learning_rate)), float(optimizer.momentum)])

    warmup_callback = hvd.callbacks.LearningRateWarmupCallback(initial, warmup_epochs=warmup)
    history = model.fit(
        X_MINE,
        Y_MINE,
        batch_size=LOCAL,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[warmup_callback, Record()],
    )
    steps = STEPS  # (detected from fit's parameters)
    rates = [warmup_lr(initial, warmup, steps, e, b) for e in range(epochs) for b in range(steps)]
    np.testing.assert_allclose([lr for lr, _ in seen], rates, rtol=1e-6)
    ends = [rates[(e + 1) * steps - 1] for e in range(epochs)]
    np.testing.assert_allclose(history.history["lr"], ends, rtol=1e-6)
    if kind == "tf_keras_legacy":  # momentum scaled by new / old rate during the batch
        olds = [initial, *rates[:-1]]
        expected = [momentum * (new / old) for new, old in zip(rates, olds)]
        np.testing.assert_allclose([m for _, m in seen], expected, rtol=1e-5)
        assert float(model.optimizer.momentum) == pytest.approx(momentum)  # restored
    else:  # Keras 3: a number the compiled step has read, left alone
        assert all(m == momentum for _, m in seen)


@pytest.mark.parametrize("K", [keras, tf_keras], ids=lambda K: K.__name__)
def test_learning_rate_schedule_callback_multiplies_from_its_start_epoch(K):
    model = build(K, K.optimizers.SGD(0.1))
    history = model.fit(
        X_MINE,
        Y_MINE,
        batch_size=LOCAL,
        epochs=4,
        verbose=0,
        callbacks=[
            hvd.callbacks.LearningRateScheduleCallback(
                0.2, multiplier=0.5, start_epoch=1, end_epoch=3
            )
        ],
    )
    # epoch 0: as compiled; 1 and 2: 0.2 * 0.5 ** (epoch - 1); 3: unchanged.
    np.testing.assert_allclose(history.history["lr"], [0.1, 0.2, 0.1, 0.1], rtol=1e-6)


@pytest.mark.parametrize("K", [keras, tf_keras], ids=lambda K: K.__name__)
def test_best_model_checkpoint_saves_the_best_epoch(K, tmp_path):
    model = build(K, K.optimizers.SGD(0.3))
    callback = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    with pytest.raises(ValueError, match="filepath"):
        model.fit(X_MINE, Y_MINE, batch_size=LOCAL, verbose=0, callbacks=[callback])
    callback.filepath = str(tmp_path / f"best{RANK}.keras")  # (one file per rank)
    weights = []

    class Record(K.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            weights.append(self.model.get_weights())

    history = model.fit(
        X_MINE, Y_MINE, batch_size=LOCAL, epochs=4, verbose=0, callbacks=[Record(), callback]
    )
    losses = history.history["loss"]
    best = int(np.argmin(losses))
    assert callback.best == pytest.approx(losses[best])
    for got, want in zip(K.models.load_model(callback.filepath).get_weights(), weights[best]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("K", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_sync_batch_normalization_is_batch_normalization_of_the_concatenated_batch(K, monkeypatch):
    # The layer of K's package: the public name's under a tf.keras of that package.
    package = K.__name__
    monkeypatch.setattr(horovod_keras, "default_keras_package", lambda: package)
    sync_layer = horovod_keras.sync_batch_normalization()
    assert keras_package(sync_layer) == package
    rows = [2 + r for r in range(SIZE)]  # batches of different sizes
    rng = np.random.default_rng(5)
    everyone = rng.normal(size=(sum(rows), 2, 3)).astype(np.float32) * 3 + 1
    upstream = rng.normal(size=everyone.shape).astype(np.float32)
    start = sum(rows[:RANK])
    mine = slice(start, start + rows[RANK])
    x_all, x_mine = tf.constant(everyone), tf.constant(everyone[mine])

    def run(layer, x, w):
        layer.build(x.shape)
        layer.set_weights(
            [np.array([1.5, 0.5, 2.0]), np.array([0.1, -0.2, 0.3]), *layer.get_weights()[2:]]
        )
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * w)
        dx, (dgamma, dbeta) = tape.gradient(loss, x), tape.gradient(loss, [layer.gamma, layer.beta])
        return (
            y.numpy(),
            dx.numpy(),
            dgamma.numpy(),
            dbeta.numpy(),
            layer.moving_mean.numpy(),
            layer.moving_variance.numpy(),
        )

    want = run(K.layers.BatchNormalization(momentum=0.5), x_all, upstream)
    got = run(sync_layer(momentum=0.5), x_mine, upstream[mine])
    y, dx, dgamma, dbeta, moving_mean, moving_variance = got
    np.testing.assert_allclose(y, want[0][mine], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx, want[1][mine], rtol=1e-4, atol=1e-5)  # through every rank
    # This rank's part of the weights' gradients; summed over the ranks, the whole.
    np.testing.assert_allclose(gather_from_all_ranks(dgamma).sum(0), want[2], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gather_from_all_ranks(dbeta).sum(0), want[3], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(moving_mean, want[4], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(moving_variance, want[5], rtol=1e-5, atol=1e-6)
    # Its overridden private Keras method is listed (and checked) in the compat boundary.
    base = K.layers.BatchNormalization
    overridden = {
        name
        for name in vars(sync_layer)
        if name.startswith("_") and not name.startswith("__") and hasattr(base, name)
    }
    listed = {m.name for m in _keras_internal.OVERRIDDEN_METHODS}
    assert overridden and overridden <= listed
    with pytest.raises(ValueError, match="fused"):
        sync_layer(fused=True)


def test_keras_faces_collectives_and_exports():
    mine = np.array([RANK + 1.0, 2.0 * RANK], np.float32)
    everyone = np.array([[r + 1.0, 2.0 * r] for r in range(SIZE)], np.float32)
    np.testing.assert_allclose(hvd.allreduce(mine).numpy(), everyone.mean(0), rtol=1e-6)
    np.testing.assert_allclose(hvd.allreduce(mine, average=False).numpy(), everyone.sum(0))
    np.testing.assert_allclose(
        hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0).numpy(), 2 * everyone.sum(0)
    )
    np.testing.assert_array_equal(hvd.allgather(mine[None]).numpy(), everyone)
    np.testing.assert_array_equal(hvd.broadcast(mine, 0).numpy(), everyone[0])
    rows = np.arange(SIZE * 2, dtype=np.float32).reshape(SIZE, 2) + RANK
    scattered = hvd.reducescatter(rows, op=hvd.Sum).numpy()
    np.testing.assert_allclose(scattered, (rows - RANK)[RANK : RANK + 1] * SIZE + sum(range(SIZE)))
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_global_variables(0)
    # Horovod's argument checks.
    with pytest.raises(ValueError, match="Average and Sum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd_tf.Max)
    with pytest.raises(ValueError, match="Adasum"):
        hvd_tf.DistributedOptimizer(keras.optimizers.SGD(), op=hvd_tf.Adasum)
    with pytest.raises(NotImplementedError, match=r"compat\.v1"):
        hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(TypeError, match="Keras optimizer"):
        hvd.DistributedOptimizer(object())
    # The public modules: what Horovod's export, and the same objects in horovod.keras.
    for module in (hvd, hvd.callbacks, hvd_standalone_keras, hvd_standalone_keras.callbacks):
        for name in module.__all__:
            assert getattr(module, name) is not None, (module.__name__, name)
    for name in set(hvd.__all__) - {"callbacks"}:
        assert getattr(hvd_standalone_keras, name) is getattr(hvd, name), name
    for name in hvd.callbacks.__all__:
        assert getattr(hvd_standalone_keras.callbacks, name) is getattr(hvd.callbacks, name)
    assert hvd_tf.SyncBatchNormalization is hvd.SyncBatchNormalization
    assert os.path.basename(hvd.elastic.__file__) == "elastic.py"
