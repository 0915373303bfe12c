"""Conformance fixtures: parametrisation from the options, a reference cache, a results log."""
from __future__ import annotations

import pytest

from layerbench.common.results import append_json_line
from layerbench.common.selection import (conformance_shapes, determinism_reason,
                                         selected_backends, shape_cases)


def pytest_addoption(parser):
    parser.getgroup("layerbench").addoption(
        "--allow-slow", action="store_true", default=False,
        help="run CPU cases estimated to take longer than common/runner.py CPU_CASE_SECONDS "
             "(default: skip them with the estimate)")


def pytest_collection_finish(session):
    """Where a selected cupy test needs the NVRTC-compiled module (test_cupy.py's `compiled`),
    start that compile now in the background: the minutes it takes then pass on another core
    while the tests before it run."""
    import background

    if "cupy" not in selected_backends(session.config):
        return
    if any(item.path.name == "test_cupy.py" and "compiled" in getattr(item, "fixturenames", ())
           for item in session.items):
        from layerbench.backends.cupy import build

        background.start(background.CUPY_NVRTC, build.compile_every_arch_with_nvrtc)


def pytest_generate_tests(metafunc):
    config = metafunc.config
    names = metafunc.fixturenames
    if "backend_name" in names:
        metafunc.parametrize("backend_name", selected_backends(config))
    if "shape" in names:
        shapes = conformance_shapes(config)
        if "case" in names:
            params = []
            for shape in shapes:
                cases, reason = shape_cases(shape, config)
                params += [pytest.param(shape, (dtype, padding),
                                        id=f"{shape.id}-{dtype}-pad{padding:g}")
                           for dtype, padding in cases]
                if not cases:  # a selected shape that yields no case is reported, not dropped
                    params.append(pytest.param(shape, None, id=f"{shape.id}-no-case",
                                               marks=pytest.mark.skip(reason=reason)))
            metafunc.parametrize("shape,case", params)
        else:
            params = []
            for shape in shapes:
                reason = determinism_reason(shape)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                params.append(pytest.param(shape, id=shape.id, marks=marks))
            metafunc.parametrize("shape", params)


class ResultsLog:
    """Appends one JSON object per case to --results-file (if given)."""

    def __init__(self, path):
        self.path = path

    def write(self, row: dict) -> None:
        """Append row as one JSON line."""
        if self.path:
            append_json_line(self.path, row)


@pytest.fixture(scope="session")
def results_log(pytestconfig) -> ResultsLog:
    """Where case rows go."""
    return ResultsLog(pytestconfig.getoption("--results-file"))


@pytest.fixture(scope="session")
def reference_cache() -> dict:
    """Reference outputs by case, shared by every backend of the session."""
    return {}


@pytest.fixture(scope="session")
def allow_slow(pytestconfig) -> bool:
    """Whether CPU cases over the time limit run (--allow-slow) instead of being skipped."""
    return bool(pytestconfig.getoption("--allow-slow", default=False))
