"""Shared pieces of layerbench: interface, registry, contract, shapes and host utilities."""
