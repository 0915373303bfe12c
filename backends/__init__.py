"""Backends: one folder each, registered in layerbench.common.registry."""
