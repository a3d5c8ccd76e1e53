"""Every process-wide effect of mpi_strategy, installed by one function.

``install()`` replaces the TensorFlow and Keras functions listed in
``EFFECTS`` (each by a wrapper from ``features/``), adds the library's log
handler, the excepthook and one exit handler. It runs when ``mpi_strategy``
is imported and whenever an MPIStrategy is built or its scope entered (Keras
imported meanwhile is then adapted), and is idempotent by one mechanism: each
replaced attribute is recorded in ``Installed.originals`` with what it replaced, and is
never replaced twice. ``uninstall()`` (for tests) puts every original back.

Every effect is scoped to this library's work: a wrapper does what the
original does unless the call belongs to a multi-rank MPIStrategy (its scope,
or an object built in it: ``features/saving/write_point.strategy_for``), or
to a model of an MPIStrategy (Keras), and the excepthook ends the job only
once a strategy spans several ranks. docs/concepts.md lists them in a table
(tests/architecture checks it against ``EFFECTS``).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from mpi_strategy._src import _keras_internal, _tf_internal
from mpi_strategy._src.core import failure, logs, timeline
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.distribute import strategy as strategy_lib
from mpi_strategy._src.features import at_exit, keras_wrappers, preemption, sharding
from mpi_strategy._src.features.elastic import ulfm_exit
from mpi_strategy._src.features.saving import calls, sharded


@dataclass(frozen=True)
class Effect:
    """One row of the table of process-wide effects (docs/concepts.md)."""

    what: str  # what is replaced or added
    why: str  # what it makes work
    acts: str  # when it changes anything


EFFECTS = (
    Effect(
        "the TensorFlow calls that write files (`_tf_internal.WRITE_CALLS`)",
        "a save made on every rank writes once per filesystem",
        "in the scope of a multi-rank MPIStrategy, for an object built in one, "
        "or outside any scope for an object no strategy built",
    ),
    Effect(
        "Checkpoint `save`, `write`, `_write` (`_tf_internal.ASYNC_CHECKPOINT_CALLS`)",
        "an asynchronous checkpoint is written in the calling thread, where ranks meet",
        "for a checkpoint of a multi-rank MPIStrategy",
    ),
    Effect(
        "the Keras 3 and tf_keras calls that write files (`_keras_internal.SITES`)",
        "Keras saves and callbacks write once per filesystem",
        "for a model of a multi-rank MPIStrategy",
    ),
    Effect(
        "Keras `reduce_per_replica`",
        "every value a step returns is reduced over all ranks as MirroredStrategy reduces it "
        "over its devices; `predict` returns every row, in input order, on every rank",
        "for a model of an MPIStrategy",
    ),
    Effect(
        "MirroredStrategy's replica context `_merge_call` (`_tf_internal.MERGE_CALL`)",
        "what merge_call returns (tf_keras' metric results) is known to be the same on every "
        "replica, so Keras leaves it as under MirroredStrategy",
        "for an MPIStrategy's replicas, once Keras is imported",
    ),
    Effect(
        "Keras 3 `LossScaleOptimizer.check_finite`",
        "a step whose gradients overflow on any replica is skipped on every rank, as one "
        "process skips it on the global batch",
        "in a replica context of an MPIStrategy of several replicas",
    ),
    Effect(
        "tf_keras `loss_scale_optimizer.strategy_supports_loss_scaling`, `_is_all_finite` "
        "(`_keras_internal.TF_KERAS_LOSS_SCALING_CHECKS`)",
        "tf_keras's mixed precision and LossScaleOptimizer accept MPIStrategy; under "
        'shard="gradients" a step whose summed gradients overflow in any rank\'s share '
        "is skipped on every rank",
        'in the scope of an MPIStrategy (the check: of shard="gradients", several replicas)',
    ),
    Effect(
        "Keras 3 `TFOptimizer.add_variable_from_reference`, `_backend_update_step`; "
        "`BaseOptimizer.save_own_variables`, `load_own_variables`, `set_weights`, `add_variable` "
        "(`_keras_internal.KERAS3_SHARDED_UPDATE`); both Kerases' legacy `.h5` "
        "`save_optimizer_weights_to_hdf5_group` (`_keras_internal.H5_OPTIMIZER_WEIGHTS`)",
        "each rank keeps the slots of its share of the variables (and, sharding gradients, "
        "receives the sum of their gradients only), updates those and "
        "gathers the others; Keras saves (`.h5` too) stream each slot from its owner, "
        "loads set what each rank holds; Adafactor's factored moments are made as slots; "
        "tf_keras's `_BaseOptimizer.build`, `_update_step`, `save_own_variables`, "
        "`load_own_variables`, `set_weights`, `add_variable`, "
        "`Optimizer.add_variable_from_reference`, "
        "`_distributed_apply_gradients_fn` (`_keras_internal.TF_KERAS_SHARDED_UPDATE`) "
        "the same for tf_keras's optimizers, and (sharding gradients) its "
        "`Optimizer.aggregate_gradients` (a reduce-scatter) and `_BaseOptimizer._clip_gradients` "
        "(the shares clipped in the step, by the norms over all ranks); its legacy "
        "`OptimizerV2._create_all_weights` raises (legacy optimizers are not sharded)",
        "for an optimizer built in the scope of an MPIStrategy(shard=...) of several ranks",
    ),
    Effect(
        "`TrackableSaver.save` (a write point, above)",
        "a checkpoint of a sharded optimizer (and a SavedModel's variables) is written in "
        "parts by the ranks that hold them, merged into one; inside `tf.function` it raises",
        "for a checkpoint holding slots of a sharded optimizer",
    ),
    Effect(
        "Keras `CallbackList.__init__`",
        "the progress bar on rank 0 only; tf_keras's BackupAndRestore accepts MPIStrategy",
        "for a model of an MPIStrategy",
    ),
    Effect(
        "tf_keras `distributed_file_utils` (4 functions), `WorkerTrainingState.__init__`",
        "every rank names the real path; the write points decide who writes",
        "for a model of an MPIStrategy",
    ),
    Effect(
        "PreemptionCheckpointHandler's private hooks (`_tf_internal.PREEMPTION_HOOKS`)",
        "a notice on any rank makes every rank save at the same step and exit",
        "for a handler built on an MPIStrategy's cluster resolver",
    ),
    Effect(
        "`sys.excepthook`",
        "an uncaught exception ends the whole MPI job instead of leaving ranks waiting",
        "once an MPIStrategy spans several ranks (or in a replacement of a lost rank)",
    ),
    Effect(
        "one `atexit` handler",
        "the ranks meet at the end (a rank saving alone finishes); timeline files "
        "are closed; elastic jobs under ULFM end without MPI_Finalize after a lost rank, "
        "and skip Open MPI 5's barrier in it once every rank is done",
        "once an MPIStrategy spans all ranks; the timeline when on; elastic.run",
    ),
    Effect(
        "a handler on the `mpi_strategy` logger",
        "every line tagged with the rank; ranks other than 0 show errors only",
        "the library's own logger only",
    ),
)

_PREEMPTION_WRAPPERS = dict(
    zip(
        _tf_internal.PREEMPTION_HOOKS,
        (
            preemption.initialize_wrapper,
            preemption.own_notice_wrapper,
            preemption.check_wrapper,
        ),
        strict=True,
    )
)

_EXCEPTHOOK = (sys, "excepthook")
_AT_EXIT = (atexit, "mpi_strategy at exit")  # (a record only: atexit is not patched)


@dataclass
class Installed:
    """What this process has installed (``PROCESS.of``)."""

    # The one record of what is installed: (owner, attribute name) -> the original.
    originals: dict[tuple[Any, str], Any] = field(default_factory=dict)
    # What the last install saw: (failure armed, Keras packages imported, how
    # many effects were installed). TensorFlow enters a strategy's scope (and so
    # calls ``install``) on every read of a distributed variable: when nothing
    # changed since, install returns at once.
    seen: tuple[Any, ...] | None = None


def _installed() -> Installed:
    return PROCESS.of(Installed)


def install() -> None:
    """Installs every process-wide effect that this process can have now
    (idempotent; see the module)."""
    seen = (
        failure.armed(),
        *(p in sys.modules for p in _keras_internal.SITES),
        len(_installed().originals),
    )
    if seen == _installed().seen:
        return
    logs.configure()
    _once(_AT_EXIT, lambda _: atexit.register(_at_exit))
    synchronous = set(_tf_internal.ASYNC_CHECKPOINT_CALLS)
    for call in _tf_internal.WRITE_CALLS:
        _replace(
            call.owner,
            call.name,
            functools.partial(
                _write_call_wrapper, call=call, synchronous=(call.owner, call.name) in synchronous
            ),
        )
    for owner, name in synchronous:  # (those not wrapped above)
        _replace(owner, name, calls.synchronous_checkpoint_wrapper)
    for name, wrapper in _PREEMPTION_WRAPPERS.items():
        _replace(_tf_internal.PREEMPTION_HANDLER, name, wrapper)
    for package, site in _keras_internal.SITES.items():
        if package in sys.modules:  # else at the next install (an MPIStrategy's scope)
            _adapt_keras(package, site)
    if failure.armed():
        _once(_EXCEPTHOOK, _excepthook_over)
    _installed().seen = (
        failure.armed(),
        *(p in sys.modules for p in _keras_internal.SITES),
        len(_installed().originals),
    )


def uninstall() -> None:
    """Puts back everything ``install`` replaced (for tests; the log handler
    and the exit handler stay, inert)."""
    _installed().seen = None
    for (owner, name), original in reversed(list(_installed().originals.items())):
        if (owner, name) != _AT_EXIT:
            setattr(owner, name, original)
    _installed().originals.clear()
    _installed().originals[_AT_EXIT] = None  # registered with atexit for good


def installed() -> list[str]:
    """What is replaced now, as "package.module.name" or "package.module.Class.name"."""
    return [
        f"{_qualified(owner)}.{name}"
        for owner, name in _installed().originals
        if (owner, name) != _AT_EXIT
    ]


def _qualified(owner: Any) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return str(owner.__name__)


def _adapt_keras(package: str, site: _keras_internal.Site) -> None:
    try:
        _once(_tf_internal.MERGE_CALL, keras_wrappers.merge_call_wrapper)
        _replace(
            site.trainer,
            "reduce_per_replica",
            functools.partial(
                keras_wrappers.reduce_per_replica_wrapper,
                auto=_keras_internal.AUTO_REDUCTION[package],
            ),
        )
        backup = importlib.import_module(site.callbacks).BackupAndRestore
        _replace(
            f"{site.callback_list}:CallbackList",
            "__init__",
            functools.partial(keras_wrappers.callback_list_init_wrapper, backup_class=backup),
        )
        for call in site.write_calls:
            _replace(
                call.owner, call.name, functools.partial(calls.write_point_wrapper, listed=call)
            )
        if package == "keras":
            _replace(
                _keras_internal.KERAS3_LOSS_SCALE_OPTIMIZER,
                "check_finite",
                keras_wrappers.check_finite_wrapper,
            )
            for owner, name, wrapper in _SHARDING_WRAPPERS:
                _replace(owner, name, wrapper)
        if package == "tf_keras":
            for owner, name, wrapper in _TF_KERAS_SHARDING_WRAPPERS:
                _replace(owner, name, wrapper)
            for name, wrapper in zip(
                _keras_internal.TF_KERAS_LOSS_SCALING_CHECKS,
                (
                    keras_wrappers.tf_keras_supports_loss_scaling_wrapper,
                    keras_wrappers.tf_keras_is_all_finite_wrapper,
                ),
                strict=True,
            ):
                _replace(_keras_internal.TF_KERAS_LOSS_SCALING, name, wrapper)
        if package == "tf_keras":
            for name in _keras_internal.TF_KERAS_FILE_UTIL_NAMES:
                _replace(
                    _keras_internal.TF_KERAS_FILE_UTILS,
                    name,
                    functools.partial(keras_wrappers.file_util_wrapper, name=name),
                )
            _replace(
                f"{_keras_internal.TF_KERAS_TRAINING_STATE}:WorkerTrainingState",
                "__init__",
                keras_wrappers.training_state_init_wrapper,
            )
    except (ImportError, AttributeError) as exc:  # pragma: no cover - another Keras
        logger.warning(
            "could not adapt %s (%s): predict() returns only this rank's rows, "
            "every rank prints progress, and saves are not write points.",
            package,
            exc,
        )


_SHARDING_WRAPPERS = (
    (
        _keras_internal.KERAS3_TF_OPTIMIZER,
        "add_variable_from_reference",
        sharding.add_variable_from_reference_wrapper,
    ),
    (
        _keras_internal.KERAS3_TF_OPTIMIZER,
        "_backend_update_step",
        sharding.backend_update_step_wrapper,
    ),
    (
        _keras_internal.KERAS3_BASE_OPTIMIZER,
        "save_own_variables",
        sharding.save_own_variables_wrapper,
    ),
    (
        _keras_internal.KERAS3_BASE_OPTIMIZER,
        "load_own_variables",
        sharding.load_own_variables_wrapper,
    ),
    (_keras_internal.KERAS3_BASE_OPTIMIZER, "set_weights", sharding.set_weights_wrapper),
    (_keras_internal.KERAS3_BASE_OPTIMIZER, "add_variable", sharding.add_variable_wrapper),
    (
        _keras_internal.H5_OPTIMIZER_WEIGHTS["keras"],
        _keras_internal.H5_SAVE_OPTIMIZER_WEIGHTS,
        sharding.save_h5_optimizer_weights_wrapper,
    ),
)


_TF_KERAS_SHARDING_WRAPPERS = (
    (_keras_internal.TF_KERAS_OPTIMIZER, "build", sharding.tf_keras_build_wrapper),
    (
        _keras_internal.TF_KERAS_DISTRIBUTED_OPTIMIZER,
        "add_variable_from_reference",
        sharding.tf_keras_add_variable_from_reference_wrapper,
    ),
    (
        _keras_internal.TF_KERAS_DISTRIBUTED_OPTIMIZER,
        "_distributed_apply_gradients_fn",
        sharding.tf_keras_apply_gradients_wrapper,
    ),
    (_keras_internal.TF_KERAS_OPTIMIZER, "_update_step", sharding.tf_keras_update_step_wrapper),
    (
        _keras_internal.TF_KERAS_DISTRIBUTED_OPTIMIZER,
        "aggregate_gradients",
        sharding.tf_keras_aggregate_gradients_wrapper,
    ),
    (
        _keras_internal.TF_KERAS_OPTIMIZER,
        "_clip_gradients",
        sharding.tf_keras_clip_gradients_wrapper,
    ),
    (_keras_internal.TF_KERAS_OPTIMIZER, "save_own_variables", sharding.save_own_variables_wrapper),
    (_keras_internal.TF_KERAS_OPTIMIZER, "load_own_variables", sharding.load_own_variables_wrapper),
    (_keras_internal.TF_KERAS_OPTIMIZER, "set_weights", sharding.set_weights_wrapper),
    (_keras_internal.TF_KERAS_OPTIMIZER, "add_variable", sharding.add_variable_wrapper),
    (
        _keras_internal.H5_OPTIMIZER_WEIGHTS["tf_keras"],
        _keras_internal.H5_SAVE_OPTIMIZER_WEIGHTS,
        sharding.save_h5_optimizer_weights_wrapper,
    ),
    (
        _keras_internal.TF_KERAS_LEGACY_CREATE_WEIGHTS.owner,
        "_create_all_weights",
        sharding.tf_keras_legacy_create_all_weights_wrapper,
    ),
)


def _write_call_wrapper(original: Any, *, call: _tf_internal.WriteCall, synchronous: bool) -> Any:
    wrapper = calls.write_point_wrapper(original, call)
    if (call.owner, call.name) == _tf_internal.SAVED_IN_PARTS:
        wrapper = sharded.save_in_parts_wrapper(wrapper)
    return calls.synchronous_checkpoint_wrapper(wrapper) if synchronous else wrapper


def _replace(where: str, name: str, wrap: Callable[[Any], Any]) -> None:
    """Replaces ``name`` of ``where`` ("package.module" or "package.module:Class")
    by ``wrap(original)``, once."""
    module_name, _, class_name = where.partition(":")
    owner: Any = importlib.import_module(module_name)
    if class_name:
        owner = getattr(owner, class_name)
    _once((owner, name), wrap)


def _once(key: tuple[Any, str], wrap: Callable[[Any], Any]) -> None:
    if key in _installed().originals:
        return
    owner, name = key
    original = getattr(owner, name, None)
    _installed().originals[key] = original
    if key != _AT_EXIT:
        setattr(owner, name, wrap(original))
    else:
        wrap(original)


def _excepthook_over(previous: Callable[..., Any]) -> Callable[..., None]:
    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if previous is not sys.__excepthook__:
            previous(exc_type, exc, tb)  # a hook the program installed itself
        failure.end_the_job(exc_type, exc, tb)

    return excepthook


def _at_exit() -> None:
    """The library's end of the program, in order: timeline files closed, the
    ranks' last meeting, and an elastic job's end under ULFM (which exits)."""
    timeline.close_all()
    at_exit.agree_on_the_end()
    ulfm_exit.end_if_elastic(_at_exit)


strategy_lib.on_scope(install)
