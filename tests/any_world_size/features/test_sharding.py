"""MPIStrategy(shard="optimizer") and shard="gradients" (features/sharding.py,
distribute/sharding.py): each rank holds the optimizer's slots for its share of
the variables only (and, with "gradients", receives only its share of the
summed gradients), and training gives the numbers of the unsharded run.

Compared in one process: the same program under MPIStrategy() and under
MPIStrategy(shard=...), bit for bit (the same sums, the same update ops, run
by the owner; a reduce-scatter's sums of three ranks may be associated
otherwise: within 1e-6 there), after every step, on every rank, for each
Keras 3 optimizer built from slots; 100 Adam steps against MirroredStrategy on
as many devices, within a stated bound. tf_keras's optimizers
(shard="optimizer") through the same tests, parametrized over the Keras
(``both_kerases``; ``saves_with_both_kerases``). A sharded checkpoint holds, key for key, the
bytes of the unsharded run's, written by the ranks that hold them; it restores
into an unsharded run and into a sharded one (an unsharded run's too), and
training goes on to the same bits. Keras' own saves (.weights.h5) too.
"""

import itertools
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import mpi_strategy
from mpi_strategy import MPIStrategyError
from mpi_strategy._src.core import logs
from mpi_strategy._src.distribute import sharding, strategy as strategy_module
from mpi_strategy._src.features.sharding import _whole, rebuild_slots, set_held
from mpi_testing import (
    LOCAL_DEVICES,
    NUM_REPLICAS,
    RANK,
    SIZE,
    WORLD,
    all_ranks_agree,
    assert_same_on_all_ranks,
    computed_on_rank0,
    local_devices,
    reference_strategy,
)

FEATURES, OUTPUTS = 5, 3
BATCH = 4 * NUM_REPLICAS  # the global batch
STEPS = 4
_rng = np.random.default_rng(11)
X = _rng.normal(size=(25 * BATCH, FEATURES)).astype(np.float32)
Y = _rng.normal(size=(25 * BATCH, OUTPUTS)).astype(np.float32)

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "rmsprop_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "lion": lambda: keras.optimizers.Lion(0.003),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.001),
    # (its update reads whole variables: none cut; factored moments of kernels)
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    # (its trust ratio reads whole variables: none cut)
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    # (its EMA copies and accumulators made before its factored moments)
    "adafactor_ema": lambda: keras.optimizers.Adafactor(
        0.05, use_ema=True, gradient_accumulation_steps=2
    ),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "sgd_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5), momentum=0.9
    ),
}


# tf_keras's optimizers it shards, with each way tf_keras clips the summed
# gradients (clipvalue, clipnorm: 1.5 clips some variables, the one cut in rows
# among them, global_clipnorm).
TF_KERAS_OPTIMIZERS = {
    "sgd_momentum": lambda: tf_keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=1.5),
    "adam_global_clipnorm": lambda: tf_keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "rmsprop_momentum": lambda: tf_keras.optimizers.RMSprop(
        0.01, momentum=0.5, centered=True, clipvalue=0.3
    ),
    "adamw": lambda: tf_keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "adagrad": lambda: tf_keras.optimizers.Adagrad(0.05),
    "adadelta": lambda: tf_keras.optimizers.Adadelta(1.0),
    "adamax": lambda: tf_keras.optimizers.Adamax(0.01),
    "lion": lambda: tf_keras.optimizers.Lion(0.003),
    # (a product over the steps outside its slots, advanced in the update of each variable)
    "nadam": lambda: tf_keras.optimizers.Nadam(0.01),
    # (its accumulator made from a whole initial value)
    "ftrl": lambda: tf_keras.optimizers.Ftrl(
        0.05, initial_accumulator_value=0.2, l1_regularization_strength=0.001
    ),
    "adafactor": lambda: tf_keras.optimizers.Adafactor(0.05),
    "adafactor_ema": lambda: tf_keras.optimizers.Adafactor(
        0.05, use_ema=True, ema_overwrite_frequency=3
    ),
    # (its loss scaled; one replica's gradient infinite at step 1: _overflow_at_step_1)
    "adam_loss_scale": lambda: tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.Adam(0.01)
    ),
}
OPTIMIZERS_OF = {keras: OPTIMIZERS, tf_keras: TF_KERAS_OPTIMIZERS}
# Each test so marked runs with Keras 3 and with tf_keras.
both_kerases = pytest.mark.parametrize("k", [keras, tf_keras], ids=["keras", "tf_keras"])
# Each test so marked writes or reads files: devices change a rank's sums (the
# custom loop and fit run with both Kerases at 2 x 2), not what it saves or
# restores, so at several devices a rank it runs with Keras 3 only (CI time;
# tf_keras's at 1 and 3 ranks).
saves_with_both_kerases = pytest.mark.parametrize(
    "k",
    [
        keras,
        pytest.param(
            tf_keras,
            marks=pytest.mark.skipif(LOCAL_DEVICES > 1, reason="tf_keras's saves: one device"),
        ),
    ],
    ids=["keras", "tf_keras"],
)


def _adam_of(k):
    """An Adam of Keras ``k`` (tf_keras's: clipped, to cover its global norm)."""
    return OPTIMIZERS_OF[k]["adam" if k is keras else "adam_global_clipnorm"]


# At one rank the optimizer is whole: nothing to compare.
partitioned = pytest.mark.skipif(SIZE == 1, reason="one rank holds everything")


@pytest.fixture(scope="module")
def sharded():
    return mpi_strategy.MPIStrategy(devices=local_devices(), shard="optimizer")


@pytest.fixture(scope="module")
def scattered():
    """ZeRO stage 2: the gradients reduce-scattered."""
    return mpi_strategy.MPIStrategy(devices=local_devices(), shard="gradients")


def _model(k=keras):
    """Three layers of different sizes, with fixed weights (of Keras ``k``):
    at 2 to 4 ranks the partition cuts the middle kernel in rows (of 48 bytes:
    cuts every 4 rows)."""
    model = k.Sequential(
        [
            k.Input((FEATURES,)),
            k.layers.Dense(32, activation="tanh"),
            k.layers.Dense(12, activation="tanh"),
            k.layers.Dense(OUTPUTS),
        ]
    )
    model.set_weights(
        [
            np.cos(np.arange(w.size) + 1.0).reshape(w.shape).astype(np.float32) * 0.4
            for w in model.get_weights()
        ]
    )
    return model


def train(
    strategy, make_optimizer, steps=STEPS, start=0, restore=None, restore_first=False, k=keras
):
    """A custom loop (``apply_gradients`` in ``strategy.run``) over global
    batches ``start`` .. ``start + steps`` (of X, Y repeated), from the checkpoint ``restore`` if
    given: the model (of Keras ``k``), the optimizer and the weights after each step."""
    return train_each(strategy, {"": make_optimizer}, steps, start, restore, restore_first, k)[""]


def train_each(
    strategy, make_optimizers, steps=STEPS, start=0, restore=None, restore_first=False, k=keras
):
    """``train`` of a model per optimizer ``{name: make_optimizer}``, all in one
    step function: ``{name: (model, optimizer, weights after each step)}``."""
    trained = {}
    with strategy.scope():
        for name, make_optimizer in make_optimizers.items():
            model, optimizer = _model(k), make_optimizer()
            if restore_first:  # (the slots are restored as the first step makes them)
                _checkpoint({name: (model, optimizer)}).read(restore)
            optimizer.build(model.trainable_variables)
            trained[name] = (model, optimizer, [])
    if restore and not restore_first:
        for name, pair in trained.items():
            _checkpoint({name: pair}).read(restore).assert_existing_objects_matched()
    return train_on(strategy, trained, steps, start)


def train_on(strategy, trained, steps, start):
    """``train_each``'s steps, on the models and optimizers of ``trained`` (returned)."""
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).repeat().skip(start).take(steps)

    @tf.function
    def step(x, y):
        def replica(x, y):
            for model, optimizer, _ in trained.values():
                scaled = isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer)
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.square(model(x) - y)) / BATCH
                    if scaled:
                        loss = optimizer.get_scaled_loss(loss)
                grads = tape.gradient(loss, model.trainable_variables)
                if scaled:
                    grads = _overflow_at_step_1(optimizer, optimizer.get_unscaled_gradients(grads))
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica, (x, y))

    for x, y in strategy.experimental_distribute_dataset(data):
        step(x, y)
        for model, _, history in trained.values():
            history.append(model.get_weights())
    return trained


def _checkpoint(trained):
    """A ``tf.train.Checkpoint`` of the models and optimizers of ``trained``
    (``{name: (model, optimizer, ...)}``), as ``model<name>``, ``optimizer<name>``."""
    pairs = {}
    for name, (model, optimizer, *_) in trained.items():
        pairs[f"model{name}"], pairs[f"optimizer{name}"] = model, optimizer
    return tf.train.Checkpoint(**pairs)


def _overflow_at_step_1(optimizer, grads):
    """``grads`` with, at step 1, the first replica's gradient of the last
    variable (held by the last rank alone) infinite: every rank skips the
    step (under shard="gradients" the last rank alone sees it in its share)."""
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    overflow = tf.logical_and(tf.equal(optimizer.iterations, 1), tf.equal(replica, 0))
    infinite = tf.fill(tf.shape(grads[-1]), np.float32(np.inf))
    return [*grads[:-1], tf.where(overflow, infinite, grads[-1])]


def _held_here(variable):
    """The rows of ``variable`` (an optimizer variable) this rank holds: a
    slice (all of them if it is not a sharded slot), or None."""
    held = sharding.held(variable)
    if held is None or held.whole_here:
        return slice(None)
    return None if held.here is None else slice(held.here.start, held.here.stop)


def _tf_variable(variable):
    """The TensorFlow variable of an optimizer variable (tf_keras's is one)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def _assert_slots_equal(optimizer, want):
    """Every optimizer variable this rank holds (or rows of it) equals ``want``'s."""
    assert len(optimizer.variables) == len(want.variables) > 0
    for v, w in zip(optimizer.variables, want.variables):
        rows, path = _held_here(v), getattr(v, "path", v.name)
        if rows == slice(None) or rows is None:  # (what a placeholder stands for)
            held = sharding.held(v)
            assert tuple(v.shape if held is None else held.shape) == tuple(w.shape), path
        if rows is not None:
            expected = w.numpy() if rows == slice(None) else w.numpy()[rows]
            np.testing.assert_array_equal(v.numpy(), expected, err_msg=path)


def _assert_trained_alike(trained, wanted, exact=True):
    """Every weight after every step equal (or, not ``exact``, within 1e-6 of
    its norm), the same on every rank; the slots this rank holds equal."""
    for name, (_, optimizer, got) in trained.items():
        _, want_optimizer, want = wanted[name]
        for step, (weights, expected) in enumerate(zip(got, want, strict=True)):
            for i, (w, e) in enumerate(zip(weights, expected, strict=True)):
                what = f"{name}: weight {i} after step {step}"
                if exact:
                    np.testing.assert_array_equal(w, e, err_msg=what)
                else:
                    assert np.linalg.norm(w - e) <= 1e-6 * np.linalg.norm(e), what
        for i, w in enumerate(got[-1]):
            assert_same_on_all_ranks(w, f"{name}: weight {i}")
        if exact:
            _assert_slots_equal(optimizer, want_optimizer)
        placeholders = [v for v in optimizer.variables if _held_here(v) is None]
        assert placeholders, name
        cut = [v for v in optimizer.variables if len(getattr(sharding.held(v), "pieces", ())) > 1]
        # (slots of rows of a variable, beside whole ones; none of WHOLE's)
        assert bool(cut) != (name in WHOLE), name
        assert all(_tf_variable(v).shape.num_elements() == 0 for v in placeholders)


# Optimizers whose variables are never cut in rows (their update reads all of one).
WHOLE = ("adafactor", "adafactor_ema", "lamb")
# Two ranks' sums are the same bits in any order; at three, MPICH's
# reduce-scatter may associate them otherwise than its all-reduce.
SUMS_ALIKE = SIZE == 2


@partitioned
@both_kerases
def test_custom_loop_matches_the_unsharded_run_bit_for_bit(strategy, sharded, scattered, k):
    """Every optimizer of OPTIMIZERS (TF_KERAS_OPTIMIZERS; at several devices
    a rank, the scattered ones), each on its own model, in one step function:
    sharded state bit for bit; reduce-scattered
    gradients (for SCATTERED_OPTIMIZERS) too at 2 ranks (the same sums; the
    clipping norms summed over the ranks' shares), within 1e-6 otherwise."""
    names = SCATTERED_OPTIMIZERS + (("adam_loss_scale", "nadam") if k is tf_keras else ())
    table = OPTIMIZERS_OF[k]
    if LOCAL_DEVICES > 1:  # (see SCATTERED_OPTIMIZERS)
        names = tuple(name for name in names if name in AT_SEVERAL_DEVICES)
        table = {name: table[name] for name in names}
    wanted = train_each(strategy, table, k=k)
    _assert_trained_alike(train_each(sharded, table, k=k), wanted)
    got = train_each(scattered, {name: OPTIMIZERS_OF[k][name] for name in names}, k=k)
    if k is tf_keras:  # (step 1 skipped, on every rank)
        for _, _, weights in (wanted["adam_loss_scale"], got["adam_loss_scale"]):
            for before, after in zip(weights[0], weights[1], strict=True):
                np.testing.assert_array_equal(after, before)
    for name in names:
        exact = SUMS_ALIKE and not _norm_of_pieces(k, name)
        _assert_trained_alike({name: got[name]}, {name: wanted[name]}, exact=exact)


def _norm_of_pieces(k, name):
    """True if, under shard="gradients", ``name`` of Keras ``k`` clips by a norm
    summed over the ranks' pieces of a variable cut in rows (tf_keras's
    clipnorm and global_clipnorm): not the bits of the whole's norm."""
    optimizer = OPTIMIZERS_OF[k][name]()
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # (a LossScaleOptimizer's)
    return k is tf_keras and bool(optimizer.clipnorm or optimizer.global_clipnorm)


# shard="gradients" changes the sums, not the updates (the same code as
# shard="optimizer"'s): a few optimizers, of one, two and three slots, with
# global norm clipping (and, tf_keras's, each clipping; CI time), and
# Adafactor (whole variables: a reduce-scatter of whole gradients). Devices
# change the sums too (each rank's replicas added first), not the updates:
# at several devices a rank (2 x 2, the Python engine) the whole table is
# left to the 3-rank launch, and of these the ones whose update reads the
# sums otherwise run there: a norm over the ranks' shares, whole variables,
# (tf_keras) a skipped step and a product advanced by each variable's update.
SCATTERED_OPTIMIZERS = ("sgd_momentum", "adam_global_clipnorm", "rmsprop_momentum", "adafactor")
AT_SEVERAL_DEVICES = ("adam_global_clipnorm", "adafactor", "adam_loss_scale", "nadam")


class _Mixed(keras.layers.Layer):
    """Variables of several kinds: a scalar, float16, a kernel cut at 2 to 4
    ranks, and one left out of the gradients (frozen after the build)."""

    def build(self, _):
        self.scale = self.add_weight(shape=(), name="scale")
        self.half = self.add_weight(shape=(96,), dtype="float16", name="half")
        self.kernel = self.add_weight(shape=(FEATURES, 96), name="kernel")
        self.frozen = self.add_weight(shape=(96,), name="frozen")

    def call(self, x):
        h = tf.matmul(x, self.kernel) + tf.cast(self.half, tf.float32) + self.frozen
        return self.scale * tf.reduce_sum(tf.tanh(h), axis=1, keepdims=True)


def train_mixed(strategy):
    """Adam on _Mixed's variables but the frozen one, given in reverse order."""
    with strategy.scope():
        layer = _Mixed()
        model = keras.Sequential([keras.Input((FEATURES,)), layer])
        model.set_weights(
            [np.cos(np.arange(w.size) + 1.0).reshape(w.shape) for w in model.get_weights()]
        )
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
    trained = [layer.kernel, layer.half, layer.scale]
    data = tf.data.Dataset.from_tensor_slices((X, Y[:, :1])).batch(BATCH).take(STEPS)

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(x) - y)) / BATCH
            optimizer.apply_gradients(zip(tape.gradient(loss, trained), trained))

        strategy.run(replica, (x, y))

    history = []
    for x, y in strategy.experimental_distribute_dataset(data):
        step(x, y)
        history.append([np.asarray(w, np.float64) for w in model.get_weights()])
    return {"mixed": (model, optimizer, history)}


@partitioned
def test_gradients_of_several_dtypes_a_scalar_and_a_subset_are_scattered_right(strategy, scattered):
    """shard="gradients" groups float16 with float32 gradients (summed in
    float32), sends a scalar as a row, and takes gradients for some of the
    variables, in another order than they were built in."""
    want = train_mixed(strategy)
    _assert_trained_alike(train_mixed(scattered), want, exact=SUMS_ALIKE)
    np.testing.assert_array_equal(want["mixed"][2][-1][3], want["mixed"][2][0][3])  # (frozen)


@partitioned
def test_100_adam_steps_match_mirrored_strategy_within_1e_6(sharded, scattered):
    """The replicas' sums are associated otherwise than MirroredStrategy's in
    one process (as unsharded, to the bit): the weights differ in the last
    bits, within 1e-6 of each weight array's norm after 100 Adam steps
    (measured, shard="optimizer": 0 at 2 ranks, 8e-8 at 3, 1e-7 at 2 x 2)."""
    steps = 100
    adam = lambda: keras.optimizers.Adam(0.003)  # noqa: E731
    want = computed_on_rank0(lambda: train(reference_strategy(), adam, steps)[2][-1])
    for on in (sharded, scattered):
        got = train(on, adam, steps)[2][-1]
        worst = max(float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, want))
        print(f"100 Adam steps, {on} vs MirroredStrategy: relative difference {worst:.2e}")
        assert worst <= 1e-6, f"{on}: largest relative difference {worst:.2e}"


# What users combine with the optimizer in fit, at once: EMA copies (kept
# whole), gradient accumulation (in a tf.cond; kept whole) and loss scaling;
# in tf_keras, EMA copies written into the weights every 3 steps (in a tf.cond),
# global norm clipping (of the summed gradients; under shard="gradients" its
# norm summed over the ranks' shares) and loss scaling.
FIT_KWARGS = dict(use_ema=True, gradient_accumulation_steps=2)
FIT_EXAMPLES = 7 * BATCH  # (an odd number of steps an epoch: one accumulated across epochs)
FIT_SETUPS = {
    keras: (FIT_KWARGS, "mixed_float16"),
    tf_keras: (
        dict(use_ema=True, ema_overwrite_frequency=3, global_clipnorm=0.05),
        "mixed_float16",
    ),
}


def fit(strategy, adam_kwargs, policy, k=keras):
    """Per-epoch losses, final weights and optimizer (the inner one under a
    ``policy``) of a short ``fit`` of Keras ``k``."""
    k.mixed_precision.set_global_policy(policy or "float32")
    try:
        with strategy.scope():
            model = _model(k)
            optimizer = k.optimizers.Adam(0.01, **adam_kwargs)
            if policy:
                optimizer = k.mixed_precision.LossScaleOptimizer(optimizer)
            model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(
            X[:FIT_EXAMPLES], Y[:FIT_EXAMPLES], batch_size=BATCH, epochs=2, shuffle=False, verbose=0
        )
    finally:
        k.mixed_precision.set_global_policy("float32")
    inner = model.optimizer.inner_optimizer if policy else model.optimizer
    return np.array(history.history["loss"]), model.get_weights(), inner, model


@partitioned
@both_kerases
def test_fit_matches_the_unsharded_run_bit_for_bit(strategy, sharded, scattered, k):
    """Adam in both stages (the other optimizers: the custom loop; CI time)."""
    adam_kwargs, policy = FIT_SETUPS[k]
    adam_kwargs = dict(adam_kwargs)
    if LOCAL_DEVICES > 1:  # (synchronizes in a tf.cond: one device per rank only)
        adam_kwargs.pop("gradient_accumulation_steps", None)
    # (tf_keras: its global norm summed over the ranks' pieces, within 1e-6)
    stages = ((sharded, True), (scattered, SUMS_ALIKE and k is keras))
    want_losses, want_weights, want_optimizer, _ = fit(strategy, adam_kwargs, policy, k)
    for on, exact in stages:
        losses, weights, optimizer, _ = fit(on, adam_kwargs, policy, k)
        close = np.testing.assert_array_equal if exact else _within_1e_6
        close(losses, want_losses, err_msg=f"{on}: losses")
        for i, (w, e) in enumerate(zip(weights, want_weights, strict=True)):
            close(w, e, err_msg=f"{on}: weight {i}")
            assert_same_on_all_ranks(w, f"weight {i}")
        if exact:
            _assert_slots_equal(optimizer, want_optimizer)
        assert any(_held_here(v) is None for v in optimizer.variables)


def _within_1e_6(got, want, err_msg=""):
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want), err_msg


@partitioned
@both_kerases
def test_each_rank_holds_its_share_of_the_slots(sharded, k):
    """Slot bytes held per rank: all of them once over the ranks, and no rank
    more than 1/N of them plus the largest variable's slots (Adam: those of
    the rows between two cuts; Adafactor, whose variables are not cut: all)."""
    for name in ("Adam", "Adafactor"):
        with sharded.scope():
            model = k.Sequential(
                [
                    k.Input((64,)),
                    k.layers.Dense(96),
                    k.layers.Dense(40),
                    k.layers.Dense(8),
                ]
            )
            optimizer = getattr(k.optimizers, name)()
            optimizer.build(model.trainable_variables)
        slots = [v for v in optimizer.variables if sharding.held(v) is not None]
        sizes = [_tf_variable(v).shape.num_elements() * tf.as_dtype(v.dtype).size for v in slots]
        everyone = WORLD.allgather(sum(sizes))
        shapes = [tuple(v.shape) for v in model.trainable_variables]
        total = sum(_slot_bytes(name, shape) for shape in shapes)
        assert sum(everyone) == total, (name, everyone)
        if name == "Adam":  # (16 rows of 4 bytes between cuts)
            largest = max(_slot_bytes(name, (16, *shape[1:])) for shape in shapes)
        else:
            largest = max(_slot_bytes(name, shape) for shape in shapes)
        assert max(everyone) <= total / SIZE + largest, (name, everyone, total)


def _slot_bytes(name, shape):
    """The bytes of the slots optimizer ``name`` has for a float32 variable of
    ``shape``: Adam's two moments; Adafactor's second moment, and of a matrix
    its means over rows and over columns."""
    if name == "Adam":
        return 2 * 4 * math.prod(shape)
    factored = math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:]) if len(shape) > 1 else 0
    return 4 * (math.prod(shape) + factored)


def test_the_partition_cuts_few_variables_and_balances_bytes_within_a_row():
    rng = np.random.default_rng(3)
    for size in (1, 2, 3, 4, 7):
        units = [(int(rng.integers(1, 300)), int(rng.integers(1, 64))) for _ in range(23)]
        units[5:5] = [(0, 16), (3, 0)]  # (variables of no elements: held whole)
        pieces = sharding.partition(units, size)
        load = np.zeros(size)
        for (rows, per_row), cut in zip(units, pieces, strict=True):
            assert cut[0].start == 0 and cut[-1].stop == rows
            for before, after in itertools.pairwise(cut):
                assert before.stop == after.start and before.rank < after.rank
            for piece in cut:
                load[piece.rank] += (piece.stop - piece.start) * per_row
        assert sum(len(cut) > 1 for cut in pieces) <= size - 1
        ranks = [p.rank for cut in pieces for p in cut]  # (what the all-gather relies on)
        assert ranks == sorted(ranks)
        assert len(pieces[5]) == len(pieces[6]) == 1
        granule = max(b * 64 // math.gcd(64, b) for _, b in units if b)  # (cuts at 64 bytes)
        assert load.max() <= sum(r * b for r, b in units) / size + granule
        # None cut (Adafactor): ranks in order, within 1/N plus the largest unit.
        whole = sharding.partition_whole(units, size)
        assert [(len(cut), *cut[0][1:]) for cut in whole] == [(1, 0, r) for r, _ in units]
        ranks = [cut[0].rank for cut in whole]
        assert ranks == sorted(ranks)
        load = np.bincount(ranks, [r * b for r, b in units], minlength=size)
        assert load.max() <= sum(r * b for r, b in units) / size + max(r * b for r, b in units)


@partitioned
@saves_with_both_kerases
def test_a_sharded_checkpoint_holds_the_unsharded_bytes_and_restores_either_way(
    strategy, sharded, scattered, shared_dir, k
):
    """Adam (cut in rows) and Adafactor (whole variables; factored moments)
    in one checkpoint."""
    optimizers = {"": _adam_of(k), "_adafactor": OPTIMIZERS_OF[k]["adafactor"]}
    unsharded = train_each(strategy, optimizers, k=k)
    plain = _checkpoint(unsharded).save(os.path.join(shared_dir, "plain", "ckpt"))
    saved = _checkpoint(train_each(sharded, optimizers, k=k)).save(
        os.path.join(shared_dir, "sharded", "ckpt")
    )
    _assert_same_keys_and_bytes(saved, plain)
    # One index and the data files of every part; the parts themselves are gone.
    listed = sorted(os.listdir(os.path.join(shared_dir, "sharded")))
    parts = len(listed) - 2
    assert listed == ["checkpoint"] + [
        f"ckpt-1.data-{i:05d}-of-{parts:05d}" for i in range(parts)
    ] + ["ckpt-1.index"]
    # Training on from either checkpoint, sharded or not, as without any checkpoint.
    # (restored before the first step makes the slots, and after)
    restores = [
        (saved, strategy, 0),
        *itertools.product((saved, plain), (sharded,), (0, 1)),
        *([(saved, scattered, 1)] if k is keras else []),  # (tf_keras: CI time)
    ]
    if LOCAL_DEVICES > 1:  # (devices change a rank's sums, not what it saves or
        # restores: the 3-rank launch runs them all; here, one each way)
        restores = [(saved, sharded, 1), (plain, sharded, 0), *restores[5:]]
    _assert_trains_on_alike(
        strategy,
        unsharded,
        optimizers,
        k,
        restores,
        exact_on=lambda on: on is not scattered or SUMS_ALIKE,
    )


def _assert_same_keys_and_bytes(saved, plain):
    """The checkpoints ``saved`` and ``plain`` hold the same keys and bytes."""
    keys = dict(tf.train.list_variables(plain))
    assert dict(tf.train.list_variables(saved)) == keys
    for key in keys:
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            np.testing.assert_array_equal(
                tf.train.load_variable(saved, key), tf.train.load_variable(plain, key), key
            )


def _assert_trains_on_alike(strategy, unsharded, optimizers, k, restores, exact_on=lambda on: True):
    """Two steps after ``STEPS`` from each of ``restores`` ``(checkpoint, on
    strategy, restored before the first step)`` give the weights of two more
    steps of ``unsharded`` (``STEPS`` steps of ``train_each`` in ``strategy``,
    which wrote the unsharded checkpoints; bit for bit where ``exact_on(on)``),
    for each of ``optimizers`` (``train_each``'s)."""
    wanted = train_on(strategy, unsharded, 2, STEPS)
    for restore, on, first in restores:
        got = train_each(
            on, optimizers, steps=2, start=STEPS, restore=restore, restore_first=first, k=k
        )
        close = np.testing.assert_array_equal if exact_on(on) else _within_1e_6
        for name, (_, _, want) in wanted.items():
            for i, (w, e) in enumerate(zip(got[name][2][-1], want[-1], strict=True)):
                close(w, e, err_msg=f"{name} weight {i} from {restore} {on} {first}")


def _saved_models(model, optimizer, path):
    """``tf.saved_model.save`` of a ``tf.Module`` holding ``model`` and
    ``optimizer``, and of ``model`` compiled with ``optimizer`` (which tracks
    it) under ``path``: the prefixes of their variables."""
    module = tf.Module()
    module.model, module.optimizer = model, optimizer
    model.compile(optimizer=optimizer, loss="mse")
    prefixes = []
    for name, obj in (("module", module), ("model", model)):
        tf.saved_model.save(obj, os.path.join(path, name))
        prefixes.append(os.path.join(path, name, "variables", "variables"))
    return prefixes


def _loaded_variable(loaded, key):
    """The variable of checkpoint ``key`` in what ``tf.saved_model.load`` made."""
    obj = loaded
    for name in key.split("/.ATTRIBUTES/")[0].split("/"):
        obj = tf.train.TrackableView(obj).children(obj)[name]
    return obj


@partitioned
@saves_with_both_kerases
def test_a_saved_model_of_a_sharded_optimizer_holds_its_slots_and_restores(
    strategy, sharded, shared_dir, k
):
    """``tf.saved_model.save`` of objects tracking a sharded optimizer writes
    its variables as a sharded checkpoint is written, in parts: the bytes of
    the unsharded run's SavedModel, key for key; ``tf.saved_model.load`` makes
    whole slots (of the unsharded values); training goes on from it, sharded
    or not, to the same bits."""
    adam = _adam_of(k)
    unsharded = train_each(strategy, {"": adam}, k=k)
    plain = _saved_models(*unsharded[""][:2], os.path.join(shared_dir, "plain"))
    model, optimizer, _ = train(sharded, adam, k=k)
    saved = _saved_models(model, optimizer, os.path.join(shared_dir, "sharded"))
    for got, want in zip(saved, plain, strict=True):
        _assert_same_keys_and_bytes(got, want)
    loaded = tf.saved_model.load(os.path.dirname(os.path.dirname(saved[0])))
    slots = [key for key, _ in tf.train.list_variables(plain[0]) if "/_variables/" in key]
    assert len(slots) >= 2 * len(model.trainable_variables), slots  # (Adam: 2 each)
    for key in slots:
        value = _loaded_variable(loaded, key).numpy()
        np.testing.assert_array_equal(value, tf.train.load_variable(plain[0], key), key)
    _assert_trains_on_alike(
        strategy, unsharded, {"": adam}, k, [(saved[0], strategy, 0), (saved[0], sharded, 1)]
    )


@partitioned
@saves_with_both_kerases
def test_a_saved_model_for_serving_is_written_as_ever(sharded, shared_dir, k):
    """A model trained sharded and saved without its optimizer (not
    compiled: not tracked; Keras 3's ``export``) serves its outputs."""
    model, _, _ = train(sharded, _adam_of(k), steps=1, k=k)
    path = os.path.join(shared_dir, "serving")
    if k is keras:
        model.export(path)
        loaded = tf.saved_model.load(path)  # (kept: its function needs its variables)
        served = loaded.serve(X[:BATCH])
    else:
        tf.saved_model.save(model, path)
        loaded = tf.saved_model.load(path)
        (served,) = loaded.signatures["serving_default"](tf.constant(X[:BATCH])).values()
    np.testing.assert_allclose(served, model(X[:BATCH]), atol=1e-6)
    keys = [key for key, _ in tf.train.list_variables(os.path.join(path, "variables", "variables"))]
    assert not [key for key in keys if "optimizer" in key], keys


@partitioned
@saves_with_both_kerases
def test_a_checkpoint_written_inside_tf_function_raises_on_every_rank(sharded, shared_dir, k):
    """Inside ``tf.function`` no rank could write the slots it holds: a
    ``tf.train.Checkpoint`` write there raises as it is traced, on every
    rank, and writes nothing (it left out the other ranks' slots)."""
    model, optimizer, _ = train(sharded, _adam_of(k), steps=1, k=k)
    write = tf.function(
        tf.train.Checkpoint(model=model, optimizer=optimizer).write, autograph=False
    )
    with pytest.raises(MPIStrategyError, match=r"inside a tf\.function.*outside tf\.function"):
        write(os.path.join(shared_dir, "in_function", "ckpt"))
    assert not os.path.exists(os.path.join(shared_dir, "in_function"))


def _slot_key(i):
    """The checkpoint key of a Keras 3 optimizer's i-th variable (under ``optimizer``)."""
    return f"optimizer/_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"


def _assert_restores_the_checkpoint(strategy, path):
    """A model and Adam built in ``strategy``'s scope and restored from
    ``path``: every variable this rank holds equals the checkpoint's."""
    with strategy.scope():
        model = _model()
        optimizer = OPTIMIZERS["adam"]()
        optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        path
    ).assert_existing_objects_matched()
    assert len(optimizer.variables) == 2 + 2 * len(model.trainable_variables)
    for i, v in enumerate(optimizer.variables[2:], start=2):  # (after iterations, rate)
        rows = _held_here(v)
        if rows is not None:
            saved = tf.train.load_variable(path, _slot_key(i))
            np.testing.assert_array_equal(v.numpy(), saved[rows])
    np.testing.assert_array_equal(
        optimizer.iterations.numpy(),
        tf.train.load_variable(path, "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"),
    )


@partitioned
@saves_with_both_kerases
def test_slots_made_again_for_the_ranks_there_are_now_are_checkpointed_as_ever(
    sharded, shared_dir, k
):
    """After ``rebuild_slots`` (elastic training, as the world shrinks) the
    optimizer lists its variables as a fresh build does: a checkpoint writes,
    with the keys and shapes of one never rebuilt."""
    model, optimizer, _ = train(sharded, _adam_of(k), steps=1, k=k)
    checkpoint = _checkpoint({"": (model, optimizer)})
    built = checkpoint.write(os.path.join(shared_dir, "built"))
    rebuild_slots(optimizer, sharded)
    rebuilt = checkpoint.write(os.path.join(shared_dir, "rebuilt"))
    assert tf.train.list_variables(rebuilt) == tf.train.list_variables(built)


@partitioned
def test_a_checkpoint_restores_at_another_world_size_and_in_one_process(sharded, shared_dir):
    """Saved sharded over every rank: restored sharded over all ranks but the
    last (a world one rank smaller), and in one process without a strategy;
    saved there (by a CheckpointManager), restored over every rank again."""
    model, optimizer, _ = train(sharded, OPTIMIZERS["adam"])
    saved = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        os.path.join(shared_dir, "all", "ckpt")
    )
    _assert_restores_the_checkpoint(sharded, saved)
    fewer_ranks = WORLD.Split(0 if RANK < SIZE - 1 else 1, RANK)
    if RANK < SIZE - 1:
        fewer = mpi_strategy.MPIStrategy(
            comm=fewer_ranks, devices=local_devices(), shard="optimizer"
        )
        _assert_restores_the_checkpoint(fewer, saved)
        model, optimizer, _ = train(fewer, OPTIMIZERS["adam"], restore=saved, start=STEPS, steps=1)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        manager = tf.train.CheckpointManager(checkpoint, os.path.join(shared_dir, "fewer"), 1)
        again = manager.save()
    if RANK == 0:
        _assert_restores_the_checkpoint(tf.distribute.get_strategy(), saved)
    again = WORLD.bcast(again if RANK == 0 else None, root=0)
    _assert_restores_the_checkpoint(sharded, again)
    fewer_ranks.Free()


@partitioned
@saves_with_both_kerases
def test_keras_weights_files_hold_every_slot_and_load_into_a_sharded_model(
    strategy, sharded, shared_dir, k
):
    """``save_weights`` and the legacy ``.h5`` ``model.save`` write the unsharded
    run's slots; both load into a sharded model (Keras 3's ``.h5`` load makes
    no slots, with or without a strategy: its saved bytes are compared only).
    AdamW (cut in rows) and Adafactor (whole variables; factored moments)."""
    names = ("adamw", "adafactor")
    wanted = train_each(strategy, {name: OPTIMIZERS_OF[k][name] for name in names}, k=k)
    got = train_each(sharded, {name: OPTIMIZERS_OF[k][name] for name in names}, k=k)
    for name in names:
        want_model, optimizer, _ = wanted[name]
        model, sharded_optimizer, _ = got[name]
        path = os.path.join(shared_dir, f"{name}.weights.h5")
        model.compile(optimizer=sharded_optimizer, loss=k.losses.MeanSquaredError())
        model.save_weights(path)
        for on in (strategy, sharded):
            with on.scope():
                loaded = _model(k)
                loaded.compile(optimizer=OPTIMIZERS_OF[k][name](), loss="mse")
                loaded.optimizer.build(loaded.trainable_variables)
            loaded.load_weights(path)
            _assert_slots_equal(loaded.optimizer, optimizer)
        if k is keras and name == "adafactor":
            continue  # (Keras 3's .h5 writer fails on its moments' equal names, unsharded too)
        want_model.compile(optimizer=optimizer, loss=k.losses.MeanSquaredError())
        saved = {how: os.path.join(shared_dir, f"{name}_{how}.h5") for how in ("sharded", "whole")}
        model.save(saved["sharded"])
        want_model.save(saved["whole"])
        _assert_equal_arrays(*(_h5_optimizer_weights(saved[how]) for how in ("sharded", "whole")))
        if k is tf_keras:
            for on in (strategy, sharded):
                with on.scope():
                    loaded = k.models.load_model(saved["sharded"])
                _assert_slots_equal(loaded.optimizer, optimizer)


def _h5_optimizer_weights(path):
    """The optimizer variables a legacy ``.h5`` file holds, in its order."""
    import h5py

    with h5py.File(path, "r") as f:
        group = f["optimizer_weights"]
        return [group[name][()] for name in group.attrs["weight_names"]]


def _assert_equal_arrays(got, want):
    assert len(got) == len(want) > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, i
        np.testing.assert_array_equal(g, w, err_msg=str(i))


@partitioned
def test_an_optimizer_it_does_not_shard_raises_on_every_rank(sharded):
    for other in (keras.optimizers.ScheduleFreeAdamW, _OwnSGD):
        with pytest.raises(MPIStrategyError, match=f"not of {other.__name__}"):
            train(sharded, lambda: other(0.01), steps=1)  # noqa: B023 (called at once)


class _OwnSGD(keras.optimizers.SGD):
    """An optimizer of one's own (its update may read a whole variable)."""

    def __init__(self, learning_rate):
        super().__init__(learning_rate, momentum=0.9)


@partitioned
def test_a_variable_given_twice_to_one_step_raises_on_every_rank(sharded):
    """(Its pieces would come twice from each rank: the all-gather would put
    them back wrong.)"""
    with sharded.scope():
        model = _model()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
    kernel = model.trainable_variables[2]  # (cut in rows)

    @tf.function(autograph=False)  # (autograph would wrap the error)
    def step():
        def replica():
            optimizer.apply_gradients([(tf.ones_like(kernel), kernel)] * 2)

        sharded.run(replica)

    with pytest.raises(MPIStrategyError, match="one variable twice"):
        step()


@partitioned
def test_a_slot_this_rank_does_not_hold_raises_when_read(sharded):
    with sharded.scope():
        model = _model()
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    elsewhere = [v for v in optimizer.variables if _held_here(v) is None]
    assert all_ranks_agree(bool(elsewhere))
    for v in elsewhere:
        with pytest.raises(MPIStrategyError, match=f"lives on {sharding.held(v).ranks()}"):
            v.numpy()


def test_shard_arguments_that_are_not_built_raise():
    with pytest.raises(MPIStrategyError, match="compression='float16' is not combined"):
        mpi_strategy.MPIStrategy(devices=local_devices(), shard="gradients", compression="float16")
    with pytest.raises(MPIStrategyError, match="expected one of"):
        mpi_strategy.MPIStrategy(devices=local_devices(), shard="everything")


# tf_keras's optimizers whose slots elastic training makes again for the
# survivors (one model each, in one step function; CI time: SGD's, and Keras
# 3's, in the launches that lose a rank): two slots and state outside them
# (Nadam's); Adafactor's factored moments and EMA copies.
REBUILT = ("nadam", "adafactor_ema")


@partitioned
def test_slots_made_again_for_other_ranks_train_on_as_unsharded(monkeypatch, k=tf_keras):
    """Elastic training after lost ranks (``rebuild_slots``, ``set_held``,
    which ``elastic/sharded.restore`` calls; the launch that loses a rank:
    tests/launchers/features/elastic/test_elastic.py): sharded optimizers
    trained on every rank make their slots again for parts of the ranks
    (pairs of ranks; at 2 ranks each alone, holding its slots whole), are set
    from their whole values, and train on there: every step and every slot
    held is the unsharded run's on the same ranks, bit for bit."""
    monkeypatch.setattr(logs, "set_rank", lambda *_: None)  # (continue_on's: process-wide)
    process = strategy_module._state()
    monkeypatch.setattr(process, "world", process.world)
    monkeypatch.setattr(process, "job", process.job)
    table = {name: OPTIMIZERS_OF[k][name] for name in REBUILT}
    strategies = [
        mpi_strategy.MPIStrategy(devices=local_devices(), shard=s) for s in (None, "optimizer")
    ]
    wanted, trained = (train_each(s, table, steps=2, k=k) for s in strategies)
    optimizers = [optimizer for _, optimizer, _ in trained.values()]
    wholes = [[_whole(v) for v in optimizer.variables] for optimizer in optimizers]
    apart = WORLD.Split(RANK // 2 if SIZE > 2 else RANK, RANK)
    for strategy in strategies:
        strategy.extended.continue_on(apart.Dup())
    for optimizer, whole in zip(optimizers, wholes):
        rebuild_slots(optimizer, strategies[1])
        for variable, value in zip(optimizer.variables, whole, strict=True):
            set_held(variable, value)
        marked = [sharding.held(v) for v in optimizer.variables if sharding.held(v)]
        assert bool(marked) == (apart.Get_size() > 1)
        assert {held.ordered.size for held in marked} <= {apart.Get_size()}
    train_on(strategies[0], wanted, 1, start=2)
    train_on(strategies[1], trained, 1, start=2)
    for name, (_, optimizer, got) in trained.items():
        _, want_optimizer, want = wanted[name]
        for step, (weights, expected) in enumerate(zip(got, want, strict=True)):
            for i, (w, e) in enumerate(zip(weights, expected, strict=True)):
                np.testing.assert_array_equal(w, e, err_msg=f"{name}: weight {i} after step {step}")
        _assert_slots_equal(optimizer, want_optimizer)


@partitioned
def test_slots_made_again_over_other_variables_on_a_rank_raise_on_every_rank(sharded):
    """Another order on one rank would cut them differently: raised as the
    rebuild starts, not at the next collective (which could be training's)."""
    with sharded.scope():
        model = _model(tf_keras)
        optimizer = tf_keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    variables = list(model.trainable_variables)
    reversed_here = variables[::-1] if RANK == SIZE - 1 else variables
    with pytest.raises(MPIStrategyError, match=rf"rank {SIZE - 1}'s 6 variables differ .* #0: "):
        rebuild_slots(optimizer, sharded, reversed_here)
    rebuild_slots(optimizer, sharded, variables)  # (left as it was: made again)


@partitioned
def test_a_tf_keras_legacy_optimizer_raises_on_every_rank(sharded):
    """Its slots are made at its first step (in a replica context here)."""
    with sharded.scope():
        model = _model(tf_keras)
        optimizer = tf_keras.optimizers.legacy.Adam()
    variables = model.trainable_variables

    @tf.function(autograph=False)  # (autograph would wrap the error)
    def step():
        sharded.run(lambda: optimizer.apply_gradients(zip(map(tf.ones_like, variables), variables)))

    with pytest.raises(MPIStrategyError, match=r"legacy optimizers \(Adam\)"):
        step()


@partitioned
def test_a_tf_keras_optimizer_it_does_not_shard_raises_on_every_rank(sharded):
    """An optimizer of one's own (its update may read a whole variable)."""

    class Own(tf_keras.optimizers.SGD):
        pass

    with sharded.scope():
        model = _model(tf_keras)
        optimizer = Own(momentum=0.9)
        with pytest.raises(MPIStrategyError, match="not of Own,"):
            optimizer.build(model.trainable_variables)
