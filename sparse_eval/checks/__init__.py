"""Checks of the harness itself on a real model, one module and one command each:

    python -m sparse_eval.checks.batch_invariance --out records.json   # every method's records at any batch

A check sits on top of the house: it loads a model, builds tasks and methods and runs the engine, so it may import
any part of the package, and nothing in the package imports it (the ground floor, e.g. ``sparse_eval.invariance``,
which the attention and kernel code imports, stays free of the runner).  Its tests are in ``tests/``.
"""
