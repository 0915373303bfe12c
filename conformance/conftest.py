"""Conformance fixtures: parametrisation from the options, a reference cache, a results log."""
from __future__ import annotations

import json

import pytest

from layerbench.common.selection import selected_backends, selected_cases, selected_shapes

HUGE_SHAPES = {14}  # shapes whose extra cases (half dtypes, determinism) are left out


def pytest_generate_tests(metafunc):
    config = metafunc.config
    names = metafunc.fixturenames
    if "backend_name" in names:
        metafunc.parametrize("backend_name", selected_backends(config))
    if "shape" in names:
        shapes = selected_shapes(config)
        if "case" in names:
            params = []
            for shape in shapes:
                for dtype, padding in selected_cases(config):
                    if shape.kind == "official" and shape.number in HUGE_SHAPES \
                            and dtype != "float32":
                        continue
                    params.append(pytest.param(shape, (dtype, padding),
                                               id=f"{shape.id}-{dtype}-pad{padding:g}"))
            metafunc.parametrize("shape,case", params)
        else:
            shapes = [s for s in shapes
                      if not (s.kind == "official" and s.number in HUGE_SHAPES)]
            metafunc.parametrize("shape", shapes, ids=[s.id for s in shapes])


class ResultsLog:
    """Appends one JSON object per case to --results-file (if given)."""

    def __init__(self, path):
        self.path = path

    def write(self, row: dict) -> None:
        """Append row as one JSON line."""
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def results_log(pytestconfig) -> ResultsLog:
    """Where case rows go."""
    return ResultsLog(pytestconfig.getoption("--results-file"))


@pytest.fixture(scope="session")
def reference_cache() -> dict:
    """Reference outputs by case, shared by every backend of the session."""
    return {}
