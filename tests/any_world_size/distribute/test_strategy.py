"""MPIStrategy's replica semantics (distribute/strategy.py, distribute/cluster_resolver.py),
at any world size and any local device count.

Expected values are written as closed forms over all replicas of all ranks;
where TensorFlow's behaviour is the reference, the same computation runs on a
MirroredStrategy with as many replicas in this process (conftest gives every
rank that many logical CPUs).
"""

import numpy as np
import pytest
import tensorflow as tf

import mpi_strategy
from mpi_testing import (
    LOCAL_DEVICES,
    NUM_REPLICAS,
    RANK,
    SIZE,
    WORLD,
    assert_same_on_all_ranks,
    local_devices,
    mpi_calls,
    mpi_strategy_under_test,
    reference_strategy,
)

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]


@pytest.fixture(scope="module")
def mirrored():
    return reference_strategy()


def replica_id():
    return tf.distribute.get_replica_context().replica_id_in_sync_group


def in_mode(fn, mode):
    return tf.function(fn) if mode == "function" else fn


MODES = ["eager", "function"]


# -- identity ----------------------------------------------------------------------
def test_replica_counts_and_global_ids(strategy):
    assert strategy.num_replicas_in_sync == NUM_REPLICAS
    ids = strategy.experimental_local_results(strategy.run(replica_id))
    assert [int(i) for i in ids] == [RANK * LOCAL_DEVICES + i for i in range(LOCAL_DEVICES)]
    gathered = strategy.gather(strategy.run(lambda: tf.reshape(replica_id(), [1])), axis=0)
    np.testing.assert_array_equal(gathered.numpy(), np.arange(NUM_REPLICAS))


def test_cluster_resolver_and_chief(strategy):
    resolver = strategy.cluster_resolver
    assert isinstance(resolver, mpi_strategy.MPIClusterResolver)
    assert isinstance(resolver, tf.distribute.cluster_resolver.ClusterResolver)
    assert resolver.task_type == "worker" and resolver.task_id == RANK
    assert resolver.cluster_spec().num_tasks("worker") == SIZE
    assert resolver.num_accelerators() == {}  # CPUs are not accelerators
    assert strategy.extended.should_checkpoint == (RANK == 0)
    assert strategy.extended.should_save_summary == (RANK == 0)
    assert strategy.extended.experimental_between_graph


def test_cluster_resolver_counts_accelerators_only():
    # TensorFlow's convention (ClusterResolver.num_accelerators): GPUs/TPUs, never CPUs.
    for devices, expected in [
        ({"CPU": 2}, {}),
        ({"GPU": 2}, {"GPU": 2}),
        ({"GPU": 1, "CPU": 1}, {"GPU": 1}),
        (None, {}),
    ]:
        resolver = mpi_strategy.MPIClusterResolver(WORLD, devices)
        assert resolver.num_accelerators() == expected, devices
        assert resolver.num_accelerators("worker", RANK) == expected, devices


# -- reductions ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", MODES)
def test_reduce_sum_and_mean_every_dtype(strategy, mirrored, dtype, mode):
    def step(s):
        def value():
            return tf.cast(tf.fill([2, 3], replica_id() + 1), dtype)

        per_replica = s.run(value)
        return (
            s.reduce("SUM", per_replica, axis=None),
            s.reduce("MEAN", per_replica, axis=None),
            s.reduce("SUM", per_replica, axis=0),
        )

    got = in_mode(lambda: step(strategy), mode)()
    want = in_mode(lambda: step(mirrored), mode)()
    n = NUM_REPLICAS
    np.testing.assert_allclose(np.float64(got[0].numpy()), np.full([2, 3], n * (n + 1) / 2))
    np.testing.assert_allclose(np.float64(got[1].numpy()), np.full([2, 3], (n + 1) / 2), rtol=1e-2)
    np.testing.assert_allclose(np.float64(got[2].numpy()), np.full([3], n * (n + 1)))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(np.float64(g.numpy()), np.float64(w.numpy()), rtol=1e-2)


@pytest.mark.parametrize("mode", MODES)
def test_reduce_mean_along_axis_with_ragged_replicas(strategy, mode):
    # Replica r holds r + 1 rows; MEAN over axis 0 weights every row equally.
    def step():
        per_replica = strategy.run(
            lambda: tf.cast(tf.fill([replica_id() + 1, 2], replica_id()), tf.float32)
        )
        return strategy.reduce("MEAN", per_replica, axis=0)

    rows = np.concatenate([np.full([r + 1, 2], r, np.float32) for r in range(NUM_REPLICAS)])
    np.testing.assert_allclose(in_mode(step, mode)().numpy(), rows.mean(axis=0), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_nested_structures_and_replica_all_reduce(strategy, mode):
    def fn():
        r = tf.cast(replica_id(), tf.float32)
        nested = {"a": r, "b": (tf.fill([3], r), tf.cast(r, tf.int64) + 1)}
        return tf.distribute.get_replica_context().all_reduce("SUM", nested)

    def step():
        out = strategy.run(fn)
        return strategy.experimental_local_results(out)

    n = NUM_REPLICAS
    for local in in_mode(step, mode)():
        assert float(local["a"]) == n * (n - 1) / 2
        np.testing.assert_array_equal(local["b"][0].numpy(), np.full([3], n * (n - 1) / 2))
        assert int(local["b"][1]) == n * (n + 1) // 2


@pytest.mark.parametrize("mode", MODES)
def test_strategy_reduce_of_a_nested_batch(strategy, mirrored, mode):
    # Keras reduces whole (x, y) batches this way when it builds a model.
    def step(s):
        per_replica = s.run(
            lambda: (
                tf.fill([2], tf.cast(replica_id(), tf.float32)),
                {"y": tf.cast(replica_id(), tf.int64) + 1},
            )
        )
        return s.reduce("MEAN", per_replica, axis=None), s.reduce("SUM", per_replica, axis=None)

    got = in_mode(lambda: step(strategy), mode)()
    want = in_mode(lambda: step(mirrored), mode)()
    tf.nest.assert_same_structure(got, want)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
    assert float(got[1][1]["y"]) == NUM_REPLICAS * (NUM_REPLICAS + 1) / 2


@pytest.mark.parametrize("mode", MODES)
def test_replica_all_gather_and_strategy_gather(strategy, mode):
    def fn():
        r = replica_id()
        return tf.distribute.get_replica_context().all_gather(tf.fill([1, 2], r), axis=1)

    def step():
        in_replica = strategy.experimental_local_results(strategy.run(fn))
        per_replica = strategy.run(lambda: tf.fill([replica_id() + 1, 2], replica_id()))
        return in_replica, strategy.gather(per_replica, axis=0)

    in_replica, gathered = in_mode(step, mode)()
    n = NUM_REPLICAS
    for local in in_replica:
        np.testing.assert_array_equal(local.numpy(), np.repeat(np.arange(n), 2)[None, :])
    np.testing.assert_array_equal(
        gathered.numpy(), np.concatenate([np.full([r + 1, 2], r) for r in range(n)])
    )


@pytest.mark.parametrize("mode", MODES)
def test_merge_call_reduce_to_batch_reduce_to_broadcast_to(strategy, mode):
    def merge_fn(s, value, doubled):
        e = s.extended
        total, doubled_total = e.batch_reduce_to("SUM", [(value, value), (doubled, value)])
        mean = e.reduce_to("MEAN", value, destinations="/device:CPU:0")
        return total, doubled_total, mean

    def fn():
        v = tf.cast(replica_id(), tf.float32) + 1.0
        return tf.distribute.get_replica_context().merge_call(merge_fn, args=(v, v * 2.0))

    def step():
        total, doubled, mean = strategy.run(fn)
        from_root = strategy.extended.broadcast_to(
            tf.constant(float(RANK + 5)), destinations=local_devices()[0]
        )
        return (
            strategy.experimental_local_results(total),
            strategy.experimental_local_results(doubled),
            mean,
            from_root,
        )

    total, doubled, mean, from_root = in_mode(step, mode)()
    n = NUM_REPLICAS
    assert all(float(t) == n * (n + 1) / 2 for t in total)
    assert all(float(d) == n * (n + 1) for d in doubled)
    assert float(mean) == (n + 1) / 2
    assert float(from_root) == 5.0


@pytest.mark.parametrize("mode", MODES)
def test_indexed_slices_reduce_like_mirrored(strategy, mirrored, mode):
    def reduce_with(s):
        def fn():
            r = replica_id()
            rows = tf.cast(tf.fill([2, 3], r + 1), tf.float32)
            return tf.IndexedSlices(
                rows, indices=tf.stack([r % 4, 5]), dense_shape=tf.constant([6, 3], tf.int64)
            )

        per_replica = s.run(fn)
        results = []
        for op in ("SUM", "MEAN"):
            reduced = s.extended.reduce_to(op, per_replica, destinations="/device:CPU:0")
            results.append(tf.convert_to_tensor(reduced))  # densify to compare
        return results

    got = in_mode(lambda: reduce_with(strategy), mode)()
    want = in_mode(lambda: reduce_with(mirrored), mode)()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
    assert got[0].numpy()[5, 0] == NUM_REPLICAS * (NUM_REPLICAS + 1) / 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtypes", [("float32", "float32"), ("float32", "float64")], ids=["one-dtype", "mixed-dtypes"]
)
def test_many_indexed_slices_batch_reduce_like_mirrored(strategy, mirrored, mode, dtypes):
    """Several tables of different widths, index dtypes and (per replica)
    row counts in one batch_reduce: each comes back whole, in replica order."""

    def reduce_with(s):
        def fn():
            r = replica_id()
            tables = []
            for t, (width, rows, dtype) in enumerate(
                [(1, 2, dtypes[0]), (3, 1, dtypes[1]), (2, None, dtypes[0])]
            ):
                n = r + 1 if rows is None else rows  # ragged: replica r has r + 1 rows
                values = tf.cast(tf.fill([n, width], 10 * t + r + 1), dtype)
                index_dtype = tf.int32 if t == 1 else tf.int64
                indices = tf.cast(tf.range(n) + r, index_dtype)
                tables.append(tf.IndexedSlices(values, indices, tf.constant([40, width], tf.int64)))
            return tables

        per_replica = s.run(fn)
        reduced = s.extended.batch_reduce_to("SUM", [(t, "/device:CPU:0") for t in per_replica])
        return [tf.convert_to_tensor(t) for t in reduced]

    got = in_mode(lambda: reduce_with(strategy), mode)()
    want = in_mode(lambda: reduce_with(mirrored), mode)()
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.numpy(), w.numpy())


@pytest.mark.parametrize("mode", MODES)
def test_sparse_and_a_few_kb_of_dense_values_reduce_in_one_collective(strategy, mirrored, mode):
    def reduce_with(s):
        def fn():
            r = tf.cast(replica_id(), tf.float32)
            sparse = tf.IndexedSlices(
                tf.fill([2, 3], r + 1), tf.constant([1, 4], tf.int64), tf.constant([6, 3], tf.int64)
            )
            return [tf.fill([5], r * 0.1 + 1.0), sparse, tf.fill([2, 2], r + 3.0)]

        per_replica = s.run(fn)
        reduced = s.extended.batch_reduce_to("SUM", [(t, "/device:CPU:0") for t in per_replica])
        return [tf.convert_to_tensor(t) for t in reduced]

    agreement = strategy.extended._cross_device_ops.ordered_comm.agreement
    before = agreement.seq
    got = in_mode(lambda: reduce_with(strategy), mode)()
    collectives = agreement.seq - before
    want = in_mode(lambda: reduce_with(mirrored), mode)()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
        assert_same_on_all_ranks(g.numpy(), "reduced value")
    if SIZE > 1:
        assert collectives == 1


def test_keras_embedding_gradient_is_sparse_and_summed(strategy):
    with strategy.scope():
        table = tf.Variable(tf.zeros([8, 2]))

    @tf.function
    def step():
        def fn():
            with tf.GradientTape() as tape:
                rows = tf.gather(table, [replica_id() % 8, 7])
                loss = tf.reduce_sum(rows)
            grad = tape.gradient(loss, table)
            assert isinstance(grad, tf.IndexedSlices)
            return tf.distribute.get_replica_context().all_reduce("SUM", grad)

        return strategy.experimental_local_results(strategy.run(fn))[0]

    dense = tf.convert_to_tensor(step()).numpy()
    expected = np.zeros([8, 2])
    for r in range(NUM_REPLICAS):
        expected[r % 8] += 1
    expected[7] += NUM_REPLICAS
    np.testing.assert_array_equal(dense, expected)


# -- variables ---------------------------------------------------------------------
def test_variables_start_from_rank0_values(strategy):
    tf.random.set_seed(1234 + RANK)  # every rank would draw different values
    with strategy.scope():
        v = tf.Variable(tf.random.normal([4, 3]))
        layer = tf.keras.layers.Dense(5)
        layer.build((None, 3))
        opt = tf.keras.optimizers.Adam()
        opt.build(layer.trainable_variables)
    for var in [v, *layer.weights, *opt.variables]:
        for local in strategy.experimental_local_results(var):
            assert_same_on_all_ranks(local.numpy(), var.name)
    assert_same_on_all_ranks(layer.kernel.numpy(), "kernel")
    assert not np.allclose(layer.kernel.numpy(), 0)  # (something was drawn)
    # Rank 0's draw itself, on every rank (not merely the same draw everywhere):
    # the first draw after rank 0's seed.
    tf.random.set_seed(1234)
    rank0_draw = tf.random.normal([4, 3]).numpy()
    for local in strategy.experimental_local_results(v):
        np.testing.assert_array_equal(local.numpy(), rank0_draw)


@pytest.mark.parametrize(
    "aggregation,expected",
    [
        (tf.VariableAggregation.SUM, lambda n: n * (n + 1) / 2),
        (tf.VariableAggregation.MEAN, lambda n: (n + 1) / 2),
        # As in MultiWorkerMirroredStrategy, reading gives this rank's first
        # replica (no collective, so rank-0-only checkpoint writes cannot hang).
        (tf.VariableAggregation.ONLY_FIRST_REPLICA, lambda n: RANK * LOCAL_DEVICES + 1.0),
    ],
)
def test_sync_on_read_variables_aggregate_globally(strategy, aggregation, expected):
    with strategy.scope():
        v = tf.Variable(
            0.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=aggregation
        )

    @tf.function
    def step():
        strategy.run(lambda: v.assign(tf.cast(replica_id(), tf.float32) + 1.0))

    step()
    assert float(v.read_value()) == pytest.approx(expected(NUM_REPLICAS))


def test_mirrored_only_first_replica_assign_takes_replica0_value(strategy):
    with strategy.scope():
        v = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    @tf.function
    def step():
        strategy.run(lambda: v.assign(tf.cast(replica_id(), tf.float32) + 10.0))

    step()
    for local in strategy.experimental_local_results(v):
        assert float(local) == 10.0


@pytest.mark.parametrize("mode", MODES)
def test_only_first_replica_update_from_the_variable_is_not_sent(strategy, mode):
    """``iterations.assign_add(1)``-style updates (the variable plus constants)
    are the same on every rank: no MPI broadcast, and still the right value."""
    with strategy.scope():
        v = tf.Variable(5.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def step():
        strategy.run(lambda: v.assign_add(1.0))
        strategy.run(lambda: v.assign(tf.maximum(v * 2.0 - 1.0, 0.0)))
        strategy.run(lambda: v.assign_add(tf.cast(replica_id(), tf.float32)))  # sent

    fn = in_mode(step, mode)
    fn()
    for local in strategy.experimental_local_results(v):
        assert float(local) == (5.0 + 1.0) * 2.0 - 1.0
    if mode == "function" and SIZE > 1:
        calls = mpi_calls(fn.get_concrete_function().graph)
        assert len(calls) == 1, calls  # only the replica-id update


def test_ranks_that_assign_different_constants_raise_at_the_next_collective():
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    strategy = mpi_strategy_under_test()
    with strategy.scope():
        v = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    strategy.run(tf.function(lambda: v.assign(v + float(RANK))))  # a per-rank constant
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="assigned different constants before it"
    ):
        strategy.reduce("SUM", tf.constant(1.0), axis=None)
    # The ranks agree again at the next collective.
    assert float(strategy.reduce("SUM", tf.constant(1.0), axis=None)) == SIZE


def test_keras_metric_is_global(strategy):
    with strategy.scope():
        metric = tf.keras.metrics.Mean()

    @tf.function
    def step():
        strategy.run(lambda: metric.update_state(tf.cast(replica_id(), tf.float32)))

    step()
    assert float(metric.result()) == pytest.approx((NUM_REPLICAS - 1) / 2)


# -- input ---------------------------------------------------------------------------
def _batches(strategy, dataset):
    out = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        out.append([t.numpy() for t in strategy.experimental_local_results(batch)])
    return out


@pytest.mark.parametrize("num_elements", [16, 13], ids=["even", "ragged-last-batch"])
def test_distribute_dataset_splits_like_mirrored(strategy, mirrored, num_elements):
    global_batch = 2 * NUM_REPLICAS
    dataset = tf.data.Dataset.range(num_elements).batch(global_batch)
    got = _batches(strategy, dataset)
    want = _batches(mirrored, dataset)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        if LOCAL_DEVICES == 1:
            # One replica per rank: exactly MirroredStrategy's split.
            np.testing.assert_array_equal(g[0], w[RANK])
        # With several devices per rank, ranks shard like MultiWorkerMirrored
        # (rank k's replica l gets piece l * size + k): the same examples per
        # step, in another replica order.
        everyone = WORLD.allgather(np.concatenate(g))
        np.testing.assert_array_equal(
            np.sort(np.concatenate(everyone)), np.sort(np.concatenate(w)), err_msg=f"step {step}"
        )


def test_uneven_shards_end_together(strategy):
    # Rank r's shard has r + 1 batches; every rank must stop together.
    def dataset_fn(ctx):
        assert ctx.num_input_pipelines == SIZE and ctx.input_pipeline_id == RANK
        per_replica = ctx.get_per_replica_batch_size(2 * NUM_REPLICAS)
        n = (ctx.input_pipeline_id + 1) * per_replica * LOCAL_DEVICES
        return tf.data.Dataset.range(n).map(lambda x: tf.cast(x, tf.float32)).batch(per_replica)

    dist = strategy.distribute_datasets_from_function(dataset_fn)

    @tf.function
    def step(batch):
        per_replica = strategy.run(lambda b: tf.cast(tf.size(b), tf.float32), args=(batch,))
        return strategy.reduce("SUM", per_replica, axis=None)

    steps = [float(step(batch)) for batch in dist]
    assert len(steps) == SIZE
    assert_same_on_all_ranks(np.array(steps), "per-step element counts")


def test_distribute_values_from_function_global_ids(strategy):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync])
    )
    local = [v.numpy().tolist() for v in strategy.experimental_local_results(values)]
    assert local == [[RANK * LOCAL_DEVICES + i, NUM_REPLICAS] for i in range(LOCAL_DEVICES)]


# -- communicators ---------------------------------------------------------------------
def test_strategies_on_disjoint_subcommunicators(strategy):
    color = RANK % 2
    sub = WORLD.Split(color, RANK)
    try:
        sub_strategy = mpi_strategy_under_test(sub)
        assert sub_strategy.num_replicas_in_sync == sub.Get_size() * LOCAL_DEVICES

        @tf.function
        def both():
            a = sub_strategy.reduce("SUM", sub_strategy.run(lambda: tf.constant(1.0)), axis=None)
            b = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
            return a, b

        a, b = both()
        assert float(a) == sub.Get_size() * LOCAL_DEVICES
        assert float(b) == NUM_REPLICAS
    finally:
        sub.Free()


# -- misuse ------------------------------------------------------------------------------
def test_rejects_a_non_mpi4py_comm():
    with pytest.raises(TypeError, match="mpi4py intracommunicator"):
        mpi_strategy.MPIStrategy(comm="COMM_WORLD")


def test_rejects_bad_communication_options():
    with pytest.raises(TypeError, match="CommunicationOptions"):
        mpi_strategy.MPIStrategy(communication_options={"timeout_seconds": 3})


def test_rejects_jit_compile_with_explanation(strategy):
    @tf.function(jit_compile=True)
    def step():
        return strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)

    if NUM_REPLICAS == 1:
        pytest.skip("one replica in total: TF skips the reduction entirely")
    with pytest.raises(Exception, match="cannot be compiled by XLA"):
        step()
