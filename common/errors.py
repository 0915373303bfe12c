"""Errors every backend raises for cases it cannot or will not run."""


class Unsupported(RuntimeError):
    """A backend cannot run this case (device, dtype, head dim, size, missing toolchain).

    The suites turn it into a skip whose reason is the message. A backend never falls back
    to another implementation instead of raising it.
    """


class MemoryPlanError(Unsupported):
    """The memory plan of a case does not fit the device; raised before any allocation."""
