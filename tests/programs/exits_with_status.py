"""Run by tests/launchers/features/elastic/test_elastic.py under ULFM: an
elastic program that ends with an exit status of its own.

    python tests/programs/exits_with_status.py STATUS inside|after PROGRAM [ARGS...]

Runs PROGRAM (an elastic program using ``mpi_strategy.elastic.run``) as
``__main__`` with ARGS, and exits with STATUS: ``inside``, by a
``sys.exit(STATUS)`` at the end of the function ``elastic.run`` decorates (as
on a preemption notice: TensorFlow's handler exits with 42); ``after``, by a
``sys.exit(STATUS)`` once the program has returned.
"""

import runpy
import sys

import mpi_strategy.elastic

status, where, path, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
if where == "inside":
    run = mpi_strategy.elastic.run

    def run_then_exit(*run_args, **run_kwargs):
        decorate = run(*run_args, **run_kwargs)

        def decorated(train):
            def train_then_exit(*train_args, **train_kwargs):
                train(*train_args, **train_kwargs)
                sys.exit(status)

            return decorate(train_then_exit)

        return decorated

    mpi_strategy.elastic.run = run_then_exit
sys.argv = [path, *args]
runpy.run_path(path, run_name="__main__")
if where == "after":
    sys.exit(status)
