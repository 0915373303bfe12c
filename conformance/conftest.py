"""Conformance fixtures: parametrisation from the options, a reference cache, a results log."""
from __future__ import annotations

import pytest

from layerbench.common.results import append_json_line
from layerbench.common.selection import (conformance_shapes, determinism_reason,
                                         selected_backends, shape_cases, skip_unless_selected)


@pytest.fixture(scope="session")
def cupy_selected(pytestconfig):
    """Skip unless --backend selects cupy."""
    skip_unless_selected(pytestconfig, "cupy")


@pytest.fixture(scope="session")
def cutile_selected(pytestconfig):
    """Skip unless --backend selects cutile."""
    skip_unless_selected(pytestconfig, "cutile")


@pytest.fixture(scope="session")
def wmma_selected(pytestconfig):
    """Skip unless --backend selects wmma."""
    skip_unless_selected(pytestconfig, "wmma")


def pytest_addoption(parser):
    parser.getgroup("layerbench").addoption(
        "--allow-slow", action="store_true", default=False,
        help="run CPU cases estimated to take longer than common/runner.py CPU_CASE_SECONDS "
             "(default: skip them with the estimate)")


def pytest_collection_finish(session):
    """Start now, in the background, the long compiles that selected tests need later: the
    cupy module by NVRTC (test_cupy.py's `compiled`), every cuTile specialisation's export
    (test_cutile.py's `cutile_build`) and the strict nvcc compile of the wmma sources
    (test_wmma.py's `strict_compiles`), so that their minutes pass on another core while the
    tests before them run."""
    import background

    backends = selected_backends(session.config)

    def needed(backend: str, file: str, fixture: str) -> bool:
        return backend in backends and any(
            item.path.name == file and fixture in getattr(item, "fixturenames", ())
            for item in session.items)
    if needed("cupy", "test_cupy.py", "compiled"):
        from layerbench.backends.cupy import build

        background.start_in_process(background.CUPY_NVRTC, build.compile_every_arch_with_nvrtc)
    if needed("cutile", "test_cutile.py", "cutile_build"):
        from layerbench.backends.cutile import launch

        if launch.jit_unavailable_reason() is None:
            root = background.scratch("layerbench-cutile-build-")  # removed by this process
            background.start_in_process(background.CUTILE_EXPORT, background.export_cutile, root)
    if needed("wmma", "test_wmma.py", "strict_compiles"):
        from layerbench.backends.wmma import build as wmma_build

        if wmma_build.nvcc_path() is not None:
            folder = background.scratch("layerbench-wmma-objects-")
            background.start_in_process(background.WMMA_STRICT, background.compile_wmma_strict,
                                        folder)


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
