"""Work a test session needs later, started early in a background thread, so that a long
compile runs on another core while the first tests run on this one. The compiles themselves
run in a spawned process (in_process): imported in a thread of the test process, their
modules register loggers while pytest's logging plugin walks the logger registry at the
start of each test phase, which then fails with "dictionary changed size during iteration"."""
from __future__ import annotations

import atexit
import functools
import multiprocessing
import shutil
import tempfile
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

CUPY_NVRTC = "cupy-nvrtc"  # the cupy module compiled by NVRTC for every arch (test_cupy.py)
CUTILE_EXPORT = "cutile-export"  # every cuTile specialisation exported (test_cutile.py)
WMMA_STRICT = "wmma-strict"  # every wmma source compiled by strict nvcc (test_wmma.py)
_JOBS: dict[str, "Job"] = {}


class Job:
    """One function running in a daemon thread; result() waits for it."""

    def __init__(self, work: Callable[[], object]):
        self._result: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], object]) -> None:
        try:
            self._result = work()
        except BaseException as exc:  # handed to whoever asks for the result
            self._error = exc

    def result(self) -> object:
        """The work's return value once it has finished; its exception raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def start(key: str, work: Callable[[], object]) -> None:
    """Run work in the background under key, unless a job of that key was started."""
    if key not in _JOBS:
        _JOBS[key] = Job(work)


def start_in_process(key: str, work: Callable[..., object], *args: object) -> None:
    """start(key, ...) for work(*args) run by in_process."""
    start(key, functools.partial(in_process, work, *args))


def result(key: str, work: Callable[[], object]) -> object:
    """work's result: from the background job of key where one was started, else run now."""
    job = _JOBS.pop(key, None)
    return job.result() if job is not None else work()


def scratch(prefix: str) -> Path:
    """A new temporary folder, removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def in_process(work: Callable[..., object], *args: object) -> object:
    """work(*args) in a freshly spawned Python process; work and args must pickle (work a
    module-level function), and so must its result or exception."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(work, *args).result()


def export_cutile(root: Path) -> Path:
    """Every cuTile specialisation of every architecture exported into root (test_cutile.py)."""
    from layerbench.backends.cutile import manifest
    from layerbench.backends.cutile.export import export

    export(manifest.ARCHS, root, progress=False)
    return root


def compile_wmma_strict(folder: Path) -> tuple[Path, dict]:
    """(folder, the strict nvcc compile of every wmma source into folder) (test_wmma.py)."""
    from layerbench.backends.wmma import build

    return folder, build.compile_strict(folder)
