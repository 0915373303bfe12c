"""Work a test session needs later, started early in a background thread, so that a long
compile runs on another core while the first tests run on this one."""
from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
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


def result(key: str, work: Callable[[], object]) -> object:
    """work's result: from the background job of key where one was started, else run now."""
    job = _JOBS.pop(key, None)
    return job.result() if job is not None else work()


def scratch(prefix: str) -> Path:
    """A new temporary folder, removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
