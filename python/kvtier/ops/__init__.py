"""Operator tools behind ``kvtier status`` and ``kvtier ls`` (docs/cli.md).

- :mod:`kvtier.ops.store_files`: what a store directory tells without opening it (namespace
  directories, device files and their superblocks, who holds each namespace's ``LOCK``).
- :mod:`kvtier.ops.report`: the reports themselves, as stable JSON objects and as tables.
"""
