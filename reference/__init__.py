"""The baseline stack of docs/spec.md and its exact oracles."""
from .model import BaselineStack, make_reference, reference_forward
from .exact import exact_output
from .oracle import streaming_forward

__all__ = ["BaselineStack", "exact_output", "make_reference", "reference_forward",
           "streaming_forward"]
