"""cuTile kernel sources (they import cuda.tile; only the export step and the JIT path load them)."""
