"""This process's state: everything mpi_strategy remembers between calls.

One object, ``PROCESS``, made at the first import and kept until the process
exits (as torch.distributed keeps a ``_World`` and Horovod a
``HorovodGlobalState``). It holds core's fields, typed here; each upper layer
keeps its own fields in a small dataclass of its module, which ``PROCESS.of``
makes once and returns ever after, so that core never imports the layers above
it. No other module keeps mutable state at module level (tests/architecture
checks it); what a thread sees alone (``threading.local``) and what is filled
at import only (registries of constants) are not process state.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


# What this module needs of the agreements and timelines it holds (it imports
# neither: every module of the package may import this one).
class Notified(Protocol):
    notice: int


class Closable(Protocol):
    def close(self) -> None: ...


@dataclass
class Process:
    """The per-process state (see the module's docstring). Core's fields:"""

    # failure.py: the abort on an unhandled error is armed; an abort is under way
    failure_armed: bool = False
    # failure.py: the communicator last armed (an ``MPI.Intracomm``): under ULFM
    # the last of its ranks alive to die of its own error ends with status 1
    failure_comm: Any = None
    aborting: bool = False
    # failure.py: tests, registered by upper layers at import, of an exception
    # that every rank raised alike (no abort for it)
    shared_errors: list[Callable[[BaseException], bool]] = field(default_factory=list)
    # errors.py: how many RanksLostErrors this process has made (failure.py
    # reads it: inside a tf.function the error loses its class, not this count)
    ranks_lost: int = 0
    # agreement.py: this rank's preemption notice (0: none), and the
    # agreements that carry it (every communicator's)
    notice: int = 0
    agreements: weakref.WeakSet[Notified] = field(default_factory=weakref.WeakSet)
    # timeline.py: the open trace files, by path
    timelines: dict[str, Closable] = field(default_factory=dict)
    # collectives.py: names each communicator in the timeline
    communicator_numbers: itertools.count[int] = field(default_factory=itertools.count)
    # the upper layers' states, by their class (``of``)
    _layers: dict[type, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def of(self, cls: type[T]) -> T:
        """The one instance of a layer's state class ``cls`` (a dataclass
        whose fields all have defaults), made at the first call."""
        state = self._layers.get(cls)
        if state is None:
            with self._lock:
                state = self._layers.setdefault(cls, cls())
        return state

    def holders(self) -> list[str]:
        """The state classes in this process, by qualified name (for the docs
        and tests: where the process state lives)."""
        return [f"{c.__module__}.{c.__qualname__}" for c in self._layers]


PROCESS = Process()
