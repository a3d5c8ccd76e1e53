"""native/engine.py and native/kernels/: the native engine (compiled kernels)
against the numpy one: the same bits, the same messages, and ranks on different
engines meeting in one collective.

distribute/test_ordered_comm.py runs each collective's own tests on both
engines; here the two engines' results are compared with each other, bit for
bit, on random data whose sums depend on the order of operations.
"""

import dataclasses
import gc
import inspect
import os
import re
import types

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy._src.core.collective_ops.base import Call
from mpi_strategy._src.core.collective_ops.broadcast import BROADCAST
from mpi_strategy._src.core.protocol import State
from mpi_strategy._src.distribute.engines import Collective
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.native import engine as native_engine
from mpi_strategy.errors import CollectiveMismatchError, MPIStrategyError
from mpi_testing import (
    NATIVE_OP_TYPES,
    RANK,
    SIZE,
    WORLD,
    assert_same_on_all_ranks,
    gather_from_all_ranks,
    mpi_calls,
    on_python_engine,
    ordered_comm,
)

pytestmark = [
    pytest.mark.device_agnostic,
    pytest.mark.skipif(SIZE == 1, reason="a 1-rank world calls no collective"),
]


@pytest.fixture(scope="module", params=["gathered", "hashed"])
def protocol(request):
    """How the ranks agree: by gathering every rank's record, or (as above
    protocol.HASHED_ABOVE ranks) by comparing a hash."""
    return request.param


def _ordered_comm(protocol):
    ordered = ordered_comm(hashed=protocol == "hashed")
    if "native" not in ordered.engines:
        pytest.skip("the native kernels are not in use (MPI_STRATEGY_KERNELS)")
    return ordered


@pytest.fixture(scope="module")
def engines(protocol):
    """(native, numpy) OrderedComms agreeing by ``protocol``."""
    return _ordered_comm(protocol), on_python_engine(_ordered_comm(protocol))


class _NoFallback:
    """In place of the native OrderedComm's Python engine: a collective that
    the kernels do not run fails instead of comparing numpy with numpy."""

    name = "no fallback"
    device = "/device:CPU:0"

    def runs(self, collective):
        return True

    def __call__(self, collective, token, inputs):
        raise AssertionError(f"the kernels do not run {collective.name}: the Python engine would")


def _both(engines, fn, in_function):
    """``fn(ordered)`` on the native and on the numpy engine, as numpy arrays
    (every collective of the first on the kernels)."""
    native = engines[0]
    results, saved = [], native._engines
    native._engines = [*(e for e in saved if e.name == "native"), _NoFallback()]
    try:
        for ordered in engines:
            call = lambda o=ordered: fn(o)  # noqa: E731
            out = tf.function(call)() if in_function else call()
            results.append([np.asarray(t) for t in tf.nest.flatten(out)])
    finally:
        native._engines = saved
    return results


def _assert_same_bits(native, python):
    assert len(native) == len(python)
    for a, b in zip(native, python):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        assert a.tobytes() == b.tobytes(), (a.ravel()[:8], b.ravel()[:8])


def _random(shape, dtype):
    rng = np.random.default_rng(1000 + RANK)
    if dtype.is_floating:
        values = rng.normal(size=shape) * 10.0 ** rng.integers(-3, 4, size=shape)
    else:
        values = rng.integers(-100 if dtype.min < 0 else 0, 100, size=shape)
    return tf.constant(values, dtype)


DTYPES = [tf.float32, tf.float64, tf.int32, tf.int64, tf.int8, tf.uint8, tf.uint16, tf.uint64]
ELEMENTS = {"carried": 5, "sent": 20000}


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("size", sorted(ELEMENTS))
@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allreduce_gives_the_same_bits_on_both_engines(engines, dtype, op, size, in_function):
    x = _random([ELEMENTS[size]], dtype)
    native, python = _both(engines, lambda o: o.allreduce_packed([x], op), in_function)
    _assert_same_bits(native, python)
    assert_same_on_all_ranks(native[0], "the reduction")


@pytest.mark.parametrize(
    "shapes", [[[3], [2, 2], []], [[70000], [3, 30000]]], ids=["packed", "large"]
)
def test_several_tensors_give_the_same_bits_on_both_engines(engines, shapes):
    # Small tensors are concatenated by TensorFlow first; large ones reach
    # the kernel as several inputs.
    xs = [_random(shape, tf.float32) for shape in shapes]
    native, python = _both(engines, lambda o: o.allreduce_packed(xs, "sum"), True)
    _assert_same_bits(native, python)


@pytest.mark.parametrize("size", sorted(ELEMENTS))
def test_broadcast_gives_the_same_bits_on_both_engines(engines, size):
    for root in range(SIZE):
        x = _random([ELEMENTS[size]], tf.float64)
        native, python = _both(engines, lambda o, r=root, x=x: o.broadcast(x, root=r), True)
        _assert_same_bits(native, python)
        assert_same_on_all_ranks(native[0], f"the broadcast from rank {root}")


@pytest.mark.parametrize("rows", [1, 500], ids=["carried", "sent"])
def test_allgather_gives_the_same_bits_on_both_engines(engines, rows):
    # Rows differ per rank (rank 1 sends none), dtypes per tensor; a scalar too.
    xs = [
        _random([rows * (RANK + 1) * (RANK != 1), 3], tf.float32),
        _random([RANK + 1], tf.int8),
        tf.constant(RANK, tf.int64),
    ]
    native, python = _both(engines, lambda o: o.allgather_many(xs), True)
    _assert_same_bits(native, python)
    assert native[0].shape == (rows * sum((r + 1) * (r != 1) for r in range(SIZE)), 3)


@pytest.mark.parametrize("rows", [1, 700], ids=["small", "large"])
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("width", [3, 0])
def test_reducescatter_gives_the_same_bits_on_both_engines(engines, rows, op, width):
    # Uneven shares when rows % SIZE != 0: the first ranks one row more.
    x = _random([rows * SIZE + SIZE // 2, width], tf.float32)
    native, python = _both(engines, lambda o: o.reducescatter(x, op), True)
    _assert_same_bits(native, python)
    assert native[0].shape[0] == rows + (1 if RANK < SIZE // 2 else 0)


def test_alltoall_and_barrier_give_the_same_bits_on_both_engines(engines):
    x = _random([SIZE, 1000], tf.int64)
    native, python = _both(engines, lambda o: (o.alltoall(x), o.barrier()), True)
    _assert_same_bits(native, python)
    everyone = gather_from_all_ranks(x.numpy())
    np.testing.assert_array_equal(native[0], everyone[:, RANK])


@pytest.mark.parametrize("width", [1, 300], ids=["carried", "sent"])
def test_alltoall_with_splits_gives_the_same_bits_on_both_engines(engines, width):
    # Rank r sends (r + d) % 3 rows to rank d (none for some), width 0 or more.
    splits = tf.constant([(RANK + d) % 3 for d in range(SIZE)], tf.int32)
    x = _random([int(tf.reduce_sum(splits)), width], tf.float32)
    empty = tf.zeros([0, 0], tf.int8)
    native, python = _both(
        engines,
        lambda o: (o.alltoallv(x, splits), o.alltoallv(empty, tf.zeros([SIZE], tf.int64))),
        True,
    )
    _assert_same_bits(native, python)
    np.testing.assert_array_equal(native[1], [(r + RANK) % 3 for r in range(SIZE)])


def test_the_kernels_run_every_collective(engines):
    native = engines[0]
    x = tf.ones([SIZE, 2])

    @tf.function
    def step():
        native.allreduce_sum(x)
        native.broadcast(x)
        native.allgather(x)
        native.alltoall(x)
        native.reducescatter(x)
        native.barrier()
        native.alltoallv(x, tf.ones([SIZE], tf.int32))

    graph = step.get_concrete_function().graph
    assert [op.type for _, op in mpi_calls(graph)] == list(NATIVE_OP_TYPES)
    step()


def test_a_kind_no_collective_has_raises_on_both_engines(engines):
    # (no engine may run something else in its place, e.g. an all-gather)
    unknown = Collective("nonesuch", "MPINonesuch", (tf.int32,), shapes=())
    native = next(e for e in engines[0]._engines if e.name == "native")
    for engine in (native, engines[1]._engines[0]):
        with pytest.raises(ValueError, match="collective kind 'nonesuch'"):
            engine(unknown, tf.constant(np.int64(0)), [])


def test_ranks_on_different_engines_meet_in_the_same_collectives(protocol):
    # Odd ranks run the numpy engine, even ones the kernels: same bytes on the wire.
    ordered = _ordered_comm(protocol)
    if RANK % 2:
        on_python_engine(ordered)

    @tf.function
    def step():
        small = ordered.allreduce_sum(tf.fill([3], float(RANK + 1)))
        large = ordered.allreduce_packed([tf.fill([5000], RANK + 1)], "max")[0]
        root = ordered.broadcast(tf.fill([2000], RANK), root=SIZE - 1)
        rows = ordered.allgather(tf.fill([RANK + 1, 2], RANK))
        ordered.barrier()
        share = ordered.reducescatter(tf.ones([SIZE, 2]))
        swapped = ordered.alltoall(tf.fill([SIZE, 2], RANK))
        split, counts = ordered.alltoallv(tf.fill([RANK * SIZE, 2], RANK), [RANK] * SIZE)
        return small, large, root, rows, share, swapped, split, counts

    for _ in range(3):
        small, large, root, rows, share, swapped, split, counts = step()
        np.testing.assert_array_equal(counts, np.arange(SIZE))
        np.testing.assert_array_equal(split[:, 0], np.repeat(np.arange(SIZE), np.arange(SIZE)))
        np.testing.assert_array_equal(share, np.full([1, 2], SIZE))
        np.testing.assert_array_equal(swapped[:, 0], np.arange(SIZE))
        np.testing.assert_array_equal(small, np.full(3, SIZE * (SIZE + 1) / 2))
        np.testing.assert_array_equal(large, np.full(5000, SIZE))
        np.testing.assert_array_equal(root, np.full(2000, SIZE - 1))
        np.testing.assert_array_equal(
            rows[:, 0], np.repeat(np.arange(SIZE), np.arange(1, SIZE + 1))
        )


def _message(error):
    text = getattr(error, "message", str(error))
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text.split("\n")[0])
    return re.sub(r"collective #\d+", "collective #N", text)


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_a_disagreement_raises_the_same_error_and_message_on_both_engines(engines, in_function):
    native = _same_error_on_both_engines(
        engines, in_function, lambda o: o.allreduce_sum(tf.ones([RANK + 1]))
    )
    assert "CollectiveMismatchError" in _message(native) if in_function else True
    if not in_function:
        assert isinstance(native, CollectiveMismatchError)


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_bad_splits_raise_the_same_error_and_message_on_both_engines(engines, in_function):
    # Rank 0's splits exceed its rows, the last rank's are one too many.
    splits = [2] * SIZE if RANK == 0 else [1] * (SIZE + (RANK == SIZE - 1))
    native = _same_error_on_both_engines(
        engines, in_function, lambda o: o.alltoallv(tf.ones([SIZE, 2]), splits)
    )
    assert f"splits of rank(s) {[0, SIZE - 1]} do not cut" in _message(native)


def _same_error_on_both_engines(engines, in_function, collective):
    """Runs the failing ``collective(ordered)`` on each engine (eagerly or in a
    tf.function); asserts the same error class and message, and that both
    engines go on. Returns the native engine's error."""
    errors = []
    for ordered in engines:
        call = lambda o=ordered: collective(o)  # noqa: E731
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            (tf.function(call) if in_function else call)()
        errors.append(info.value)
    native, python = errors
    assert type(native) is type(python)
    assert _message(native) == _message(python)
    for ordered in engines:  # and both go on
        np.testing.assert_array_equal(ordered.allreduce_sum(tf.ones([2])), [SIZE, SIZE])
    return native


def test_a_retired_communicator_raises_its_error_from_the_kernels(protocol):
    native = _ordered_comm(protocol)
    native.collectives.retire(lambda: RuntimeError("this communicator was replaced"))
    with pytest.raises(RuntimeError, match="was replaced"):
        native.allreduce_sum(tf.ones([2]))
    with pytest.raises(
        tf.errors.UnknownError, match="RuntimeError: this communicator was replaced"
    ):
        tf.function(lambda: native.broadcast(tf.ones([2])))()


def _traced_allreduce(ordered):
    """A concrete function of one all-reduce of ``ordered``, holding no
    reference to it (as a graph that outlives its communicator)."""
    return tf.function(lambda x: ordered.allreduce_sum(x)).get_concrete_function(
        tf.TensorSpec([2], tf.float32)
    )


def test_a_graph_that_outlives_its_communicator_raises_and_its_state_is_freed(protocol):
    # The kernels find their communicator's state by id in the library's
    # memory, which goes with the communicator (not with the process).
    kernels = native_engine.kernels()
    gc.collect()
    before = kernels.states_open()
    ordered = _ordered_comm(protocol)
    assert kernels.states_open() == before + 1
    step = _traced_allreduce(ordered)
    np.testing.assert_array_equal(step(tf.ones([2])), [SIZE, SIZE])
    del ordered
    gc.collect()
    assert kernels.states_open() == before
    with pytest.raises(tf.errors.UnknownError, match="a communicator that is gone"):
        step(tf.ones([2]))


def test_a_graph_from_another_process_finds_no_communicator_here(protocol):
    # A GraphDef written by another process (here: this one's, with the
    # engine id another process's salt would give) raises, and MPI is not called.
    ordered = _ordered_comm(protocol)
    ids = gather_from_all_ranks(ordered.agreement.state[State.ENGINE])
    assert len(set(ids.ravel().tolist())) == SIZE, ids  # (each process's ids are its own)
    graph_def = _traced_allreduce(ordered).graph.as_graph_def()
    kernels = [n for n in graph_def.node if n.op.startswith("MpiStrategy")]
    assert [n.op for n in kernels] == ["MpiStrategyAllreduce"]
    kernels[0].attr["engine"].i ^= 1 << 40
    inputs = {n.attr["dtype"].type: n.name for n in graph_def.node if n.op == "Placeholder"}
    x, token = inputs[tf.float32.as_datatype_enum], inputs[tf.resource.as_datatype_enum]
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        feed = tf.compat.v1.placeholder(tf.float32, [2])
        variable = tf.compat.v1.get_variable(
            "token", initializer=tf.constant(0, tf.int64), use_resource=True
        )
        result = tf.graph_util.import_graph_def(
            graph_def,
            input_map={x: feed, token: variable.handle},
            return_elements=[f"{kernels[0].name}:1"],
        )
        session.run(variable.initializer)
        with pytest.raises(tf.errors.UnknownError, match="a communicator that is gone"):
            session.run(result, {feed: [1.0, 1.0]})
    np.testing.assert_array_equal(ordered.allreduce_sum(tf.ones([2])), [SIZE, SIZE])


def test_a_native_op_without_an_attribute_its_kernel_reads_raises_while_tracing(engines):
    # A broadcast's root has a C++ default (0): left out, the kernel would
    # broadcast from rank 0. Each call is checked against protocol.ATTRS and
    # the op's NativeOp.reads while tracing.
    (native,) = [e for e in engines[0]._engines if e.name == "native"]

    def trace_broadcast(**attrs):
        spec = dataclasses.replace(
            BROADCAST, native=dataclasses.replace(BROADCAST.native, attrs=lambda p, d: attrs)
        )
        call = Call(root=1, shapes=((2,),))
        traced = tf.function(autograph=False)(
            lambda: native._kernels.run(spec, call, tf.constant(0, tf.int64), [tf.zeros([2])])
        )
        return traced.get_concrete_function()  # (traced only: nothing runs)

    trace_broadcast(root=1)
    with pytest.raises(MPIStrategyError, match=r"MpiStrategyBroadcast .*left out: \['root'\]"):
        trace_broadcast()
    with pytest.raises(MPIStrategyError, match=r"not there: \['roots'\]"):
        trace_broadcast(root=1, roots=1)


def test_kernels_whose_ops_differ_from_the_registry_are_refused_at_load(engines):
    # (core/collective_ops declares each op's inputs; protocol.ATTRS its attributes)
    ops = native_engine.kernels().ops
    native_engine.check_ops(ops, "the library")
    names = [n for n in dir(ops) if n.startswith("mpi_strategy_")]
    drifted = types.SimpleNamespace(**{n: getattr(ops, n) for n in names})
    del drifted.mpi_strategy_barrier
    signature = inspect.signature(ops.mpi_strategy_alltoallv)
    renamed = [
        p.replace(name="counts") if p.name == "splits" else p for p in signature.parameters.values()
    ]
    drifted.mpi_strategy_alltoallv = lambda **kwargs: None
    drifted.mpi_strategy_alltoallv.__signature__ = signature.replace(parameters=renamed)
    with pytest.raises(native_engine.Unavailable) as refused:
        native_engine.check_ops(drifted, "the library")
    said = str(refused.value)
    assert "MpiStrategyBarrier: missing there" in said, said
    assert "MpiStrategyAlltoallv: ['token', 'input', 'counts'," in said, said


def test_the_engine_in_use_is_reported():
    # What active() reports is what a collective is built of (its op type),
    # and what MPI_STRATEGY_KERNELS asked for when it names an engine.
    reported = native_engine.active()
    ordered = OrderedComm(WORLD)
    built = [op.type for _, op in mpi_calls(_traced_allreduce(ordered).graph)]
    assert built == [{"native": "MpiStrategyAllreduce", "python": "PyFunc"}[reported]], built
    assert ordered.engines[0] == reported
    asked = os.environ.get(native_engine.KERNELS_ENV, "auto").lower()
    assert asked not in ("native", "python") or reported == asked


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_save_on_one_rank_meets_a_collective_on_the_others(engines, engine):
    # Rank 0 saves alone (a partial meeting: it goes on without the others),
    # while the others already wait in an all-reduce, which rank 0 then joins.
    from mpi_strategy._src.features.saving.write_point import WRITE

    ordered = engines[["native", "python"].index(engine)]
    if RANK == 0:
        assert ordered.agreement.agree(WRITE, np.uint8, [], tag="alone") is None
        assert ordered.agreement.solo_with == [0]
    np.testing.assert_array_equal(ordered.allreduce_sum(tf.ones([3])), [SIZE] * 3)
    np.testing.assert_array_equal(ordered.allgather(tf.fill([1], RANK)), np.arange(SIZE))
