"""Horovod's Keras callbacks, for Keras 3 and tf_keras models alike.

Each callback class here is written once; an instance's class is made from it
and the ``Callback`` (or ``ModelCheckpoint``) class of one Keras package, so
that the package's ``fit`` sees one of its own callbacks: ``tf.keras``'s
package when the callback is made (tf_keras under ``TF_USE_LEGACY_KERAS=1``,
else Keras 3), and the model's package if ``fit`` passes it a model of the
other one (``set_model`` then remakes the Keras part of the callback).
``isinstance(cb, BroadcastGlobalVariablesCallback)`` holds either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.horovod import basics
from mpi_strategy._src.horovod.api import grouped_allreduce
from mpi_strategy._src.horovod.functions import broadcast_variables
from mpi_strategy._src.horovod.mpi_ops import Average
from mpi_strategy._src.horovod.optimizer import (
    default_keras_package,
    keras_module,
    keras_package,
    optimizer_variables,
)


@dataclass
class MadeClasses:
    """The callback classes made on the fly, by (abstract class, Keras package) (``PROCESS.of``)."""

    by_key: dict[tuple[type, str], type] = field(default_factory=dict)


def _made_class(cls: type, package: str) -> Any:
    """``cls`` with the Keras class it builds on (``cls._keras_base``) of ``package`` after it."""
    key = (cls, package)
    made = PROCESS.of(MadeClasses).by_key
    if key not in made:
        base = getattr(keras_module(package, "callbacks"), cls._keras_base)  # type: ignore[attr-defined]
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "_hvd_abstract": cls,
            "_hvd_package": package,
            "_hvd_base": base,
        }
        made[key] = type(cls.__name__, (cls, base), namespace)
    return made[key]


class _KerasCallback:
    """The base of the callbacks here (see the module)."""

    _keras_base = "Callback"  # the class of the Keras package's callbacks module built on
    _hvd_abstract: type  # on made classes: the class written here (or a subclass of it)
    _hvd_package: str  # on made classes: "keras" or "tf_keras"
    _hvd_base: Any  # on made classes: the Keras class
    model: Any  # (set by Keras)
    params: dict[str, Any]  # (set by Keras)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if "_hvd_package" in cls.__dict__:
            return object.__new__(cls)
        return object.__new__(_made_class(cls, default_keras_package()))

    def _init_keras_base(self, **kwargs: Any) -> None:
        """Initializes the Keras class this instance's class builds on."""
        self.__dict__["_hvd_base_kwargs"] = kwargs
        type(self)._hvd_base.__init__(self, **kwargs)

    def set_model(self, model: Any) -> None:
        """Keras' ``set_model``, on a callback of the model's Keras package."""
        package = keras_package(model)
        if package is not None and package != type(self)._hvd_package:
            self.__class__ = _made_class(type(self)._hvd_abstract, package)
            self._init_keras_base(**self.__dict__.get("_hvd_base_kwargs", {}))
        super().set_model(model)  # type: ignore[misc]


class BroadcastGlobalVariablesCallback(_KerasCallback):
    """At the end of the first training batch, sets the model's variables and
    its optimizer's to their values on ``root_rank``: every rank goes on from
    the same state (random initial weights, a checkpoint read on one rank).
    Variables in ``local_variables`` (or ``register_local_var``) stay as they
    are on each rank."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        self._init_keras_base()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars: dict[int, Any] = {}
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        for var in local_variables:
            if not hasattr(var, "assign"):
                raise ValueError("All local variables must be of tf.Variable type.")
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leaves ``var`` out of the broadcast."""
        self._local_vars[id(var)] = var

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """(Once) every rank's model and optimizer variables become root_rank's."""
        if self.broadcast_done:
            return
        with tf.device(self.device):
            variables = [v for v in self.model.variables if id(v) not in self._local_vars]
            broadcast_variables(variables, root_rank=self.root_rank)
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None:
                broadcast_variables(optimizer_variables(optimizer), root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(_KerasCallback):
    """At the end of each epoch, replaces every value of the epoch's logs by
    its average over the ranks (one reduction for all of them): the callbacks
    after this one (ReduceLROnPlateau, TensorBoard, EarlyStopping, ...) and
    ``History`` see the same values on every rank. Every rank must log the
    same names."""

    def __init__(self, device: str = "") -> None:
        self._init_keras_base()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Averages ``logs`` over the ranks, in place."""
        if not logs:
            return
        names = sorted(logs)
        values = [np.asarray(logs[name], dtype=np.float64) for name in names]
        with tf.device(self.device):
            reduced = grouped_allreduce([tf.constant(v) for v in values], op=Average)
        for name, value, mean in zip(names, values, reduced):
            logs[name] = float(mean) if value.ndim == 0 else mean.numpy()


class LearningRateScheduleCallback(_KerasCallback):
    """From epoch ``start_epoch`` to ``end_epoch`` (excluded), sets the
    optimizer's learning rate to ``initial_lr * multiplier(epoch)`` (a number
    ``m``: ``m ** (epoch - start_epoch)``): at the first batch of each epoch
    (``staircase``), or at every batch with the fractional epoch ``epoch +
    batch / steps_per_epoch``. Logs the learning rate as ``lr`` each epoch.

    ``momentum_correction``: during a batch whose learning rate changed, the
    momentum is scaled by ``new_lr / old_lr`` (restored after the batch), as
    in Goyal et al. This applies where the momentum is a variable (tf_keras's
    legacy optimizers); Keras 3's and tf_keras's optimizers hold it as a
    number that a compiled train step has already read, so it is left alone.
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: Any,
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        self._init_keras_base()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        self.restore_momentum: float | None = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self) -> int:
        params = getattr(self, "params", None) or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError(
            "Could not autodetect the number of steps per epoch. Please specify the "
            f"steps_per_epoch parameter to the {type(self).__name__}()."
        )

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _value(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr:
            self.restore_momentum = _value(momentum)
            optimizer.momentum = self.restore_momentum * new_lr / old_lr

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum:
            self.model.optimizer.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Finds the number of steps per epoch if the schedule needs it."""
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Remembers the epoch."""
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Sets the learning rate of this batch (inside the schedule's epochs)."""
        epoch = self.current_epoch if self.current_epoch is not None else 0
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(epoch)
        elif not self.staircase:
            self._adjust_learning_rate(epoch + float(batch) / float(self.steps_per_epoch or 1))

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Restores a corrected momentum."""
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Logs the learning rate as ``lr``."""
        if logs is not None:
            logs["lr"] = _value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raises the learning rate gradually, at every batch, from ``initial_lr /
    size`` to ``initial_lr`` over ``warmup_epochs`` epochs (Goyal et al.):
    ``lr(e) = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)`` with
    ``e = epoch + (batch + 1) / steps_per_epoch`` (so each epoch ends on a
    round value). ``verbose``: rank 0 prints when the warmup ends.
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / float(self.steps_per_epoch or 1)
            size = basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Logs ``lr``; at the last warmup epoch, rank 0 prints it (``verbose``)."""
        super().on_epoch_end(epoch, logs)
        last = self.end_epoch is not None and epoch == self.end_epoch - 1
        if last and self.verbose > 0 and basics.rank() == 0:
            new_lr = _value(self.model.optimizer.learning_rate)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {new_lr:g}.")


class BestModelCheckpoint(_KerasCallback):
    """The package's ``ModelCheckpoint`` with ``save_best_only=True`` and no
    path yet: set ``filepath`` before training (Horovod's Spark estimator
    does). Each rank that has it saves; add it on rank 0 only (or rely on
    mpi_strategy's write points), as Horovod's docs advise."""

    _keras_base = "ModelCheckpoint"
    filepath: Any

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
    ) -> None:
        self._init_keras_base(
            filepath=None,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )

    def _init_keras_base(self, **kwargs: Any) -> None:
        filepath = self.__dict__.get("filepath")  # (set by the program before a remake)
        if type(self)._hvd_package == "keras":
            # Keras 3 checks the extension of the path it is given.
            placeholder = "best.weights.h5" if kwargs.get("save_weights_only") else "best.keras"
            kwargs = dict(kwargs, filepath=placeholder)
        super()._init_keras_base(**kwargs)
        self.filepath = filepath

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Checks that a path was set."""
        if self.filepath is None:
            raise ValueError(
                "BestModelCheckpoint has no filepath: set `callback.filepath = ...` before "
                "training (a .keras file, or .weights.h5 with save_weights_only=True)"
            )
        super().on_train_begin(logs)  # type: ignore[misc]


def _value(x: Any) -> float:
    """A learning rate or momentum (a variable, tensor or number) as a float."""
    if hasattr(x, "numpy"):
        return float(x.numpy())
    return float(np.asarray(x))
