"""The baseline stack of docs/spec.md and its exact oracles."""
from .model import BaselineStack, make_reference, reference_forward
from .exact import exact_output, reference_plan, streams_reference
from .oracle import oracle_plan, packed_attention, streaming_forward

__all__ = ["BaselineStack", "exact_output", "make_reference", "oracle_plan", "packed_attention",
           "reference_forward", "reference_plan", "streaming_forward", "streams_reference"]
