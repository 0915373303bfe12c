"""Command-line options shared by the conformance and benchmark suites."""
from __future__ import annotations

import os
import random

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    group = parser.getgroup("layerbench")
    group.addoption("--backend", action="append", default=None,
                    help="backend name to test (repeatable, comma lists, 'all' or 'peers'; "
                         "default all)")
    group.addoption("--shapes", default=None,
                    help="'official', 'ci', or numbers such as '1,8,13' / 'ci3' "
                         "(default: official on a GPU, ci on a CPU)")
    group.addoption("--dtype", action="append", default=None,
                    choices=["float32", "float16", "bfloat16"],
                    help="input dtypes to test (repeatable; default all three)")
    group.addoption("--padding", action="append", type=float, default=None,
                    help="padding ratios for the float32 cases (repeatable; default 0 and 0.25); "
                         "the benchmark pads its inputs at the first (default 0)")
    group.addoption("--seed", type=int, default=None,
                    help="seed of inputs and parameters (default: fresh each run, printed)")
    group.addoption("--device", default=None, help="'cuda' or 'cpu' (default: cuda if present)")
    group.addoption("--results-file", default=None,
                    help="append one JSON line per conformance case to this file")


def pytest_configure(config):
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
