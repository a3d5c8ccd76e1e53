"""TensorFlow's ``PreemptionCheckpointHandler`` on an MPIStrategy's ranks.

TensorFlow's handler agrees between workers through its coordination
service's key-value store, which MPI jobs do not have. For a handler built
on an MPIStrategy's cluster resolver, ``effects.py`` installs the wrappers
below over the handler's private hooks (``_tf_internal.PREEMPTION_HOOKS``):

* the handler is built as for one worker (no coordination service, no
  watcher thread); every rank restores the latest checkpoint and saves
  through the same ``CheckpointManager`` (one writer per filesystem,
  ``features/saving``);
* a notice (the signal TensorFlow watches, SIGTERM by default, or the
  ``termination_watcher_fn`` of ``TerminationConfig`` turning true) is posted
  to the agreement that precedes every collective
  (``core.agreement.post_notice``): every rank learns it from the same
  collective, so every rank decides at the same step, with no MPI call of
  its own;
* at the next ``run`` / ``save_checkpoint_if_preempted`` after that
  collective, every rank saves one checkpoint and calls the ``exit_fn``
  (TensorFlow's default: ``sys.exit(42)``). With a ``grace_period``, the ranks
  save, train on, and save again and exit when the first rank finds the
  grace period (less TensorFlow's margin of six steps) over: during that
  countdown alone, one small all-reduce per step agrees on it.
"""

from __future__ import annotations

import functools
import signal
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from mpi_strategy._src.core import agreement
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.distribute.cluster_resolver import MPIClusterResolver

# TensorFlow's own margin before the end of a grace period: three times the
# time of two steps (failure_handling.py).
_STEPS_OF_MARGIN = 6


def _resolver(handler: Any) -> MPIClusterResolver | None:
    """The MPIStrategy's resolver this handler was built on, else None."""
    resolver = getattr(handler, "_cluster_resolver", None)
    return resolver if isinstance(resolver, MPIClusterResolver) else None


def initialize_wrapper(original: Callable[..., None]) -> Callable[..., None]:
    """``_initialize_for_mirrored_and_multi_worker_mirrored``: on MPI, as for
    one worker (TensorFlow's local mode), on every rank."""

    @functools.wraps(original)
    def initialize(handler: Any) -> None:
        resolver = _resolver(handler)
        if resolver is None:
            return original(handler)
        handler._cluster_resolver = None  # (local mode: no key-value store)
        try:
            original(handler)
        finally:
            handler._cluster_resolver = resolver

    return initialize


def own_notice_wrapper(original: Callable[..., None]) -> Callable[..., None]:
    """``_maybe_set_received_own_sigterm``, which TensorFlow's SIGTERM handler
    and its polling of ``termination_watcher_fn`` call: this rank's notice
    (posted as SIGTERM either way)."""

    @functools.wraps(original)
    def received(handler: Any) -> None:
        if _resolver(handler) is not None:
            agreement.post_notice(signal.SIGTERM)  # (the first notice stays)
        original(handler)

    return received


def check_wrapper(original: Callable[..., None]) -> Callable[..., None]:
    """``_check_preemption_and_maybe_checkpoint``: on MPI, decided by the
    notice every rank learnt from the same collective."""

    @functools.wraps(original)
    def check(handler: Any, *args: Any, **kwargs: Any) -> None:
        resolver = _resolver(handler)
        if resolver is None:
            return original(handler, *args, **kwargs)
        noticed = resolver.noticed()
        if noticed is None:
            return None
        if handler._grace_period > 0 and not _grace_period_over(handler, resolver, args, kwargs):
            return None
        logger.info(
            "preemption notice (signal %d, learnt at collective %d): saving a "
            "checkpoint after run %d and exiting",
            *noticed,
            handler._run_counter,
        )
        handler._save_checkpoint(*args, **kwargs)
        handler._stop_poll_termination_signal_thread()
        handler._exit_fn()
        return None

    return check


def _grace_period_over(
    handler: Any, resolver: MPIClusterResolver, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """With a grace period: the first call after the notice saves and starts
    the countdown; later calls agree (one all-reduce) whether any rank's
    countdown is over. The same answer on every rank."""
    if not handler._final_checkpoint_countdown:
        handler._save_checkpoint(*args, **kwargs)
        handler._final_checkpoint_countdown = True
        handler._target_time_for_termination = (
            time.time() + handler._grace_period - _STEPS_OF_MARGIN * handler._estimated_run_time
        )
        logger.info("preemption notice: checkpoint saved; training on for the grace period")
        return False
    over = float(time.time() >= handler._target_time_for_termination)
    collectives = resolver.ordered_comm()
    return bool(collectives.allreduce_sum(tf.constant([over])).numpy()[0] > 0)
