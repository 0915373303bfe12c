"""cuTile kernel sources. They import cuda.tile, so only the export step and the JIT path
load them."""
