"""MPIStrategy(shard="optimizer") (features/sharding.py, distribute/sharding.py):
each rank holds the optimizer's slots for its share of the variables only, and
training gives the numbers of the unsharded run.

Compared in one process: the same program under MPIStrategy() and under
MPIStrategy(shard="optimizer"), bit for bit (the same sums, the same update
ops, run by the owner), after every step, on every rank, for each Keras 3
optimizer built from slots; 100 Adam steps against MirroredStrategy on as many
devices, within a stated bound. A sharded checkpoint holds, key for key, the
bytes of the unsharded run's, written by the ranks that hold them; it restores
into an unsharded run and into a sharded one (an unsharded run's too), and
training goes on to the same bits. Keras' own saves (.weights.h5) too.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpi_strategy
from mpi_strategy import MPIStrategyError
from mpi_strategy._src.distribute import sharding
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
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "sgd_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5), momentum=0.9
    ),
}


# At one rank the optimizer is whole: nothing to compare.
partitioned = pytest.mark.skipif(SIZE == 1, reason="one rank holds everything")


@pytest.fixture(scope="module")
def sharded():
    return mpi_strategy.MPIStrategy(devices=local_devices(), shard="optimizer")


def _model():
    """Three layers of different sizes, with fixed weights."""
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(9, activation="tanh"),
            keras.layers.Dense(7, activation="tanh"),
            keras.layers.Dense(OUTPUTS),
        ]
    )
    model.set_weights(
        [
            np.cos(np.arange(w.size) + 1.0).reshape(w.shape).astype(np.float32) * 0.4
            for w in model.get_weights()
        ]
    )
    return model


def train(strategy, make_optimizer, steps=STEPS, start=0, restore=None):
    """A custom loop (``apply_gradients`` in ``strategy.run``) over global
    batches ``start`` .. ``start + steps``, from the checkpoint ``restore`` if
    given: the model, the optimizer and the weights after each step."""
    return train_each(strategy, {"": make_optimizer}, steps, start, restore)[""]


def train_each(strategy, make_optimizers, steps=STEPS, start=0, restore=None):
    """``train`` of a model per optimizer ``{name: make_optimizer}``, all in one
    step function: ``{name: (model, optimizer, weights after each step)}``."""
    trained = {}
    with strategy.scope():
        for name, make_optimizer in make_optimizers.items():
            model, optimizer = _model(), make_optimizer()
            optimizer.build(model.trainable_variables)
            trained[name] = (model, optimizer, [])
    if restore:
        for model, optimizer, _ in trained.values():
            checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
            checkpoint.read(restore).assert_existing_objects_matched()
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).skip(start).take(steps)

    @tf.function
    def step(x, y):
        def replica(x, y):
            for model, optimizer, _ in trained.values():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.square(model(x) - y)) / BATCH
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica, (x, y))

    for x, y in strategy.experimental_distribute_dataset(data):
        step(x, y)
        for model, _, history in trained.values():
            history.append(model.get_weights())
    return trained


def _held_here(variable):
    """True if this rank holds ``variable`` (a slot it owns, or any other optimizer variable)."""
    held = sharding.held(variable)
    return held is None or held.owner == RANK


def _assert_slots_equal(optimizer, want):
    assert len(optimizer.variables) == len(want.variables) > 0
    for v, w in zip(optimizer.variables, want.variables):
        assert tuple(v.shape) == tuple(w.shape), v.path
        if _held_here(v):
            np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)


@partitioned
def test_custom_loop_matches_the_unsharded_run_bit_for_bit(strategy, sharded):
    """Every optimizer of OPTIMIZERS, each on its own model, in one step function."""
    wanted, trained = train_each(strategy, OPTIMIZERS), train_each(sharded, OPTIMIZERS)
    for name, (_, optimizer, got) in trained.items():
        _, want_optimizer, want = wanted[name]
        for step, (weights, expected) in enumerate(zip(got, want, strict=True)):
            for i, (w, e) in enumerate(zip(weights, expected, strict=True)):
                np.testing.assert_array_equal(w, e, err_msg=f"{name}: weight {i} after step {step}")
        for i, w in enumerate(got[-1]):
            assert_same_on_all_ranks(w, f"{name}: weight {i}")
        _assert_slots_equal(optimizer, want_optimizer)
        placeholders = [v for v in optimizer.variables if not _held_here(v)]
        assert placeholders, name
        assert all(v.value.shape.num_elements() == 0 for v in placeholders)


@partitioned
def test_100_adam_steps_match_mirrored_strategy_within_1e_6(sharded):
    """The replicas' sums are associated otherwise than MirroredStrategy's in
    one process (as unsharded, to the bit): the weights differ in the last
    bits, within 1e-6 of each weight array's norm after 100 Adam steps
    (measured: 0 at 2 ranks, 1e-7 at 3, 8e-8 at 2 x 2)."""
    steps = 100
    got = _looped(sharded, steps)
    want = computed_on_rank0(lambda: _looped(reference_strategy(), steps))
    worst = max(float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, want))
    print(f"100 Adam steps, sharded vs MirroredStrategy: relative difference {worst:.2e}")
    assert worst <= 1e-6, f"largest relative difference {worst:.2e}"


def _looped(strategy, steps):
    """The weights after ``steps`` Adam steps over X, Y (batches repeated)."""
    with strategy.scope():
        model = _model()
        optimizer = keras.optimizers.Adam(0.003)
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).repeat().take(steps)

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(x) - y)) / BATCH
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica, (x, y))

    for x, y in strategy.experimental_distribute_dataset(data):
        step(x, y)
    return model.get_weights()


# What users combine with the optimizer in fit, at once: EMA copies (kept
# whole), gradient accumulation (in a tf.cond; kept whole) and loss scaling.
FIT_KWARGS = dict(use_ema=True, gradient_accumulation_steps=2)


def fit(strategy, adam_kwargs, policy):
    """Per-epoch losses, final weights and optimizer of a short ``fit``."""
    keras.mixed_precision.set_global_policy(policy or "float32")
    try:
        with strategy.scope():
            model = _model()
            optimizer = keras.optimizers.Adam(0.01, **adam_kwargs)
            if policy:
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return np.array(history.history["loss"]), model.get_weights(), model.optimizer, model


@partitioned
def test_fit_matches_the_unsharded_run_bit_for_bit(strategy, sharded):
    adam_kwargs = dict(FIT_KWARGS)
    if LOCAL_DEVICES > 1:  # (synchronizes in a tf.cond: one device per rank only)
        del adam_kwargs["gradient_accumulation_steps"]
    want_losses, want_weights, want_optimizer, _ = fit(strategy, adam_kwargs, "mixed_float16")
    losses, weights, optimizer, _ = fit(sharded, adam_kwargs, "mixed_float16")
    np.testing.assert_array_equal(losses, want_losses)
    for i, (w, e) in enumerate(zip(weights, want_weights, strict=True)):
        np.testing.assert_array_equal(w, e, err_msg=f"weight {i}")
        assert_same_on_all_ranks(w, f"weight {i}")
    _assert_slots_equal(optimizer.inner_optimizer, want_optimizer.inner_optimizer)


@partitioned
def test_each_rank_holds_its_share_of_the_slots(sharded):
    """Slot bytes held per rank: all of them once over the ranks, and no rank
    more than 1/N of them plus the largest variable's slots."""
    with sharded.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(96),
                keras.layers.Dense(40),
                keras.layers.Dense(8),
            ]
        )
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    slots = [v for v in optimizer.variables if len(v.shape) > 0]
    held_bytes = sum(
        v.value.shape.num_elements() * tf.as_dtype(v.dtype).size for v in slots if _held_here(v)
    )
    total = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in slots)
    largest_unit = 2 * max(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    everyone = WORLD.allgather(held_bytes)
    assert sum(everyone) == total, everyone
    assert max(everyone) <= total / SIZE + largest_unit, (everyone, total)
    assert max(everyone) < total


def test_the_partition_balances_bytes_and_ignores_the_order_of_the_variables():
    rng = np.random.default_rng(3)
    for size in (1, 2, 3, 4, 7):
        units = [(f"v{i}", int(rng.integers(1, 10_000))) for i in range(23)]
        owners = sharding.partition(units, size)
        order = rng.permutation(len(units))
        shuffled = sharding.partition([units[i] for i in order], size)
        assert [owners[i] for i in order] == shuffled
        load = np.bincount(owners, weights=[b for _, b in units], minlength=size)
        assert load.max() <= sum(b for _, b in units) / size + max(b for _, b in units)


@partitioned
def test_a_sharded_checkpoint_holds_the_unsharded_bytes_and_restores_either_way(
    strategy, sharded, shared_dir
):
    adam = OPTIMIZERS["adam"]
    model, optimizer, _ = train(strategy, adam)
    plain = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        os.path.join(shared_dir, "plain", "ckpt")
    )
    model, optimizer, _ = train(sharded, adam)
    saved = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        os.path.join(shared_dir, "sharded", "ckpt")
    )
    keys = dict(tf.train.list_variables(plain))
    assert dict(tf.train.list_variables(saved)) == keys
    for key in keys:
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            np.testing.assert_array_equal(
                tf.train.load_variable(saved, key), tf.train.load_variable(plain, key), key
            )
    assert sorted(os.listdir(os.path.join(shared_dir, "sharded"))) == sorted(
        ["checkpoint", "ckpt-1.index"] + [f"ckpt-1.data-{i:05d}-of-{SIZE:05d}" for i in range(SIZE)]
    )
    # Training on from either checkpoint, sharded or not, as without any checkpoint.
    _, _, want = train(strategy, adam, steps=STEPS + 2)
    for restore in (saved, plain):
        for on in (strategy, sharded):
            _, _, got = train(on, adam, steps=2, start=STEPS, restore=restore)
            for i, (w, e) in enumerate(zip(got[-1], want[-1], strict=True)):
                np.testing.assert_array_equal(w, e, err_msg=f"weight {i} from {restore}")


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
        if _held_here(v):
            np.testing.assert_array_equal(v.numpy(), tf.train.load_variable(path, _slot_key(i)))
    np.testing.assert_array_equal(
        optimizer.iterations.numpy(),
        tf.train.load_variable(path, "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"),
    )


@partitioned
def test_a_checkpoint_restores_at_another_world_size_and_in_one_process(sharded, shared_dir):
    """Saved sharded over every rank: restored sharded over all ranks but the
    last (a world one rank smaller), and in one process without a strategy;
    saved there, restored over every rank again."""
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
        again = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
            os.path.join(shared_dir, "fewer", "ckpt")
        )
    if RANK == 0:
        _assert_restores_the_checkpoint(tf.distribute.get_strategy(), saved)
    again = WORLD.bcast(again if RANK == 0 else None, root=0)
    _assert_restores_the_checkpoint(sharded, again)
    fewer_ranks.Free()


@partitioned
def test_keras_weights_files_hold_every_slot_and_load_into_a_sharded_model(
    strategy, sharded, shared_dir
):
    path = os.path.join(shared_dir, "model.weights.h5")
    _, optimizer, _ = train(strategy, OPTIMIZERS["adam"])
    model, sharded_optimizer, _ = train(sharded, OPTIMIZERS["adam"])
    model.compile(optimizer=sharded_optimizer, loss="mse")
    model.save_weights(path)
    for on in (strategy, sharded):
        with on.scope():
            loaded = _model()
            loaded.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
            loaded.optimizer.build(loaded.trainable_variables)
        loaded.load_weights(path)
        _assert_slots_equal(loaded.optimizer, optimizer)


@partitioned
def test_an_optimizer_with_other_per_variable_state_raises_on_every_rank(sharded):
    # (raised while tracing the step: inside tf.function's StagingError)
    with pytest.raises(Exception, match=r"MPIStrategyError: .*cannot partition Adafactor"):
        train(sharded, lambda: keras.optimizers.Adafactor(0.01), steps=1)


@partitioned
def test_a_slot_this_rank_does_not_hold_raises_when_read(sharded):
    with sharded.scope():
        model = _model()
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    elsewhere = [v for v in optimizer.variables if not _held_here(v)]
    assert all_ranks_agree(bool(elsewhere))
    for v in elsewhere:
        with pytest.raises(MPIStrategyError, match=f"lives on rank {sharding.held(v).owner}"):
            v.numpy()


def test_shard_arguments_that_are_not_built_raise():
    with pytest.raises(MPIStrategyError, match="not built yet"):
        mpi_strategy.MPIStrategy(devices=local_devices(), shard="gradients")
    with pytest.raises(MPIStrategyError, match="expected one of"):
        mpi_strategy.MPIStrategy(devices=local_devices(), shard="everything")


def test_elastic_training_of_a_sharded_strategy_raises(sharded, tmp_path):
    with pytest.raises(MPIStrategyError, match="elastic training needs MPIStrategy"):
        mpi_strategy.elastic.run(sharded, str(tmp_path))


@partitioned
def test_a_tf_keras_optimizer_raises_on_every_rank(sharded):
    tf_keras = pytest.importorskip("tf_keras")
    with sharded.scope():
        model = tf_keras.Sequential([tf_keras.Input((FEATURES,)), tf_keras.layers.Dense(2)])
        optimizer = tf_keras.optimizers.Adam()
        with pytest.raises(MPIStrategyError, match="tf_keras's Adam is not sharded yet"):
            optimizer.build(model.trainable_variables)
