"""A generative differential fuzzer and its suite check (``test_generated.py``): generated
models, wrap plans, configs and training programs, FSDP vs DDP, shrunk to a runnable
reproduction (docs/fuzz.md).

    fsdp-conformance fuzz --impl torch-fsdp2 --examples 200 --seed 0 --out repro.py

Inside your own multi-rank test (``dist`` fixture)::

    from fsdp_conformance.suite.fuzz import fuzz
    result = fuzz(adapter, dist, examples=50, seed=0)      # the FuzzResult, on every rank

The case types (``FuzzCase`` ...) are plain frozen dataclasses (``spec.py``);
the strategies need hypothesis (the ``test`` extra) and are imported only when used.
"""

from __future__ import annotations

from .compare import Outcome, run_case
from .driver import FuzzResult, fuzz, require_hypothesis
from .spec import Block, FuzzCase, ModelSpec, Program, Seq, Step, describe

__all__ = [
    "Block",
    "FuzzCase",
    "FuzzResult",
    "ModelSpec",
    "Outcome",
    "Program",
    "Seq",
    "Step",
    "describe",
    "fuzz",
    "require_hypothesis",
    "run_case",
]
