"""Command-line options shared by the conformance and benchmark suites, checked once at start."""
from __future__ import annotations

import os
import random

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def wmma_objects(tmp_path_factory):
    """One folder per test session for the wmma sources compiled to objects, named
    '<source>-sm<arch>.o' (the compile test writes them; the SASS report reuses them)."""
    return tmp_path_factory.mktemp("wmma-objects")


def pytest_addoption(parser):
    group = parser.getgroup("layerbench")
    group.addoption("--backend", action="append", default=None,
                    help="backend name to test (repeatable, comma lists, 'all' or 'peers'; "
                         "default all)")
    group.addoption("--shapes", default=None,
                    help="'official', 'ci', 'noncausal', 'ci-noncausal', 'headdims', or a list "
                         "such as '1,8,13' / 'ci3' / 'nc8' / 'hd48' (conformance default: "
                         "official,noncausal,headdims on a GPU, ci,ci-noncausal,headdims on a "
                         "CPU; the benchmark: official or ci)")
    group.addoption("--dtype", action="append", default=None,
                    choices=["float32", "float16", "bfloat16"],
                    help="input dtypes to test (repeatable; default all three)")
    group.addoption("--padding", action="append", type=float, default=None,
                    help="padding ratios in [0, 1) for the float32 cases (repeatable; default "
                         "0 and 0.25); the benchmark pads its inputs at the first (default 0)")
    group.addoption("--seed", type=int, default=None,
                    help="non-negative seed of inputs and parameters (default: fresh each run, "
                         "printed)")
    group.addoption("--device", default=None,
                    help="'cuda' (needs a CUDA device) or 'cpu' (default: cuda if present)")
    group.addoption("--results-file", default=None,
                    help="append one JSON line per checked case to this file (benchmark "
                         "rows carry \"source\": \"bench\")")


def _check_options(config) -> None:
    """Raise pytest.UsageError (exit 4, one line) for a bad layerbench option."""
    from layerbench.common.cli import (check_backends, check_device, check_padding,
                                       check_seed, check_shapes)

    checks = [("--backend", check_backends, config.getoption("--backend")),
              ("--shapes", check_shapes, config.getoption("--shapes")),
              ("--device", check_device, config.getoption("--device")),
              ("--seed", check_seed, config.getoption("--seed"))]
    checks += [("--padding", check_padding, p) for p in config.getoption("--padding") or []]
    for option, check, value in checks:
        if value is None:
            continue
        try:
            check(value)
        except ValueError as exc:
            raise pytest.UsageError(f"{option}: {exc}") from None


def pytest_configure(config):
    _check_options(config)
    if config.getoption("--seed") is None:
        config.option.seed = random.SystemRandom().randrange(1 << 30)


def pytest_report_header(config):
    device = config.getoption("--device") or ("cuda" if torch.cuda.is_available() else "cpu")
    return f"layerbench: seed {config.getoption('--seed')} (rerun with --seed), device {device}"


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The device under test."""
    name = pytestconfig.getoption("--device") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@pytest.fixture(scope="session")
def seed(pytestconfig) -> int:
    """The session's seed."""
    return pytestconfig.getoption("--seed")
