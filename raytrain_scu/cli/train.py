"""``python -m raytrain_scu.train [--verbose] CONFIG.yaml key=value...``: resolve the config, then run it on Ray Train.

Exit 0 when the run finished, 2 for bad input (found before any worker starts where possible), 130 after Ctrl-C
and 143 after SIGTERM (a preemption; the run stops after the current step with a checkpoint), 1 when the run failed
(its root cause in one line).
"""
from __future__ import annotations

import os
import shlex
import sys
import threading

from raytrain_scu.config.io import help_text
from raytrain_scu.driver.early import check_inputs
from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import USER_ERRORS, DeviceOutOfMemory, DiskFullError, Interrupted, Preempted
from raytrain_scu.tracking.store import ui_command

USAGE = "usage: python -m raytrain_scu.train [--verbose] CONFIG.yaml [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    resume_cmd = shlex.join(["python", "-m", "raytrain_scu.train", *argv])
    verbose = "--verbose" in argv  # Ray's and the workers' logs on the console, as well as in their files
    argv = [a for a in argv if a != "--verbose"]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        if argv:  # --help: every key, its default and meaning, generated from the config tree
            print("\n" + help_text())
        return 0 if argv else 2
    try:
        # presets, memory fit and checks, once; the storage path and the data before anything reads the model
        cfg = resolve(argv[0], argv[1:], early=check_inputs)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the driver imports torch, transformers and Ray: only once the config and its inputs are known to be good
    from raytrain_scu.driver import run as driver

    try:
        driver.run(cfg, verbose=verbose, inputs_checked=True, ui=ui_command(cfg, argv[0], argv[1:]))
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:  # SIGTERM: the MLflow run is KILLED, exit 143 (128 + SIGTERM, as a shell reports it)
        print(preempted_line(e, resume_cmd), flush=True)
        return 143
    except (Interrupted, KeyboardInterrupt) as e:  # Ctrl-C: the MLflow run is KILLED, exit 130
        step = getattr(e, "step", None)
        done = ", checkpoint written" if getattr(e, "checkpointed", False) else ", no checkpoint of it"
        print("[raytrain_scu] interrupted" + (f" at step {step}{done}" if step is not None else "")
              + f"; resume: {resume_cmd}", flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - a failed run: its root cause in one line, not Ray's wrapping
        cause, notices = driver.failure(e)
        if cause is None and isinstance(e, (DiskFullError, DeviceOutOfMemory)):  # the driver's own write failed
            cause = f"{type(e).__name__}: {e}"
        if cause is None:
            raise
        for text in notices:  # what rank 0 said that no report carried: the failure's context
            print(f"[raytrain_scu] {text}", flush=True)
        print(f"error: {cause}", file=sys.stderr)
        return 1
    return 0


def preempted_line(e: Preempted, resume_cmd: str) -> str:
    """What the console says after a SIGTERM: the last report's step (if any came), whether it has a checkpoint,
    why the run did not wait for the step in flight's (if it did not), and the command that resumes."""
    if e.step is None:
        said = "preempted before the first report"
    else:
        said = f"preempted at step {e.step}; " + ("checkpoint written" if e.checkpointed else "no checkpoint of it")
    return (f"[raytrain_scu] {said}" + (f" ({e.why})" if e.why else "")
            + f"; re-run the same command to resume: {resume_cmd}")


def entry() -> None:
    """The program (``python -m raytrain_scu.train``, ``raytrain-scu-train``): :func:`main`'s exit code. After a
    second Ctrl-C, fit()'s thread may still be inside Ray's client, and the interpreter's teardown of Ray's threads
    can kill a driver joined to a running Ray with SIGSEGV instead of exiting 130, also once that thread has just
    ended: after an interrupted or preempted run (130, 143) or with that thread alive, the process ends at once, its
    output flushed (the MLflow run is already KILLED; the processes of a local Ray it started die with it, as Ray
    sets them up)."""
    code = main()
    launch = sys.modules.get("raytrain_scu.ray.launch")  # imported only once a run started
    if launch is not None and (code in (130, 143) or any(t.name == launch.FIT_THREAD and t.is_alive()
                                                         for t in threading.enumerate())):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
