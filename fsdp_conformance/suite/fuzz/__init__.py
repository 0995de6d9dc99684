"""A generative differential fuzzer (FSDP vs DDP on generated models, wrap plans, configs and
training programs, shrunk to a runnable reproduction; docs/fuzz.md) and its suite check.

    fsdp-conformance fuzz --impl torch-fsdp2 --examples 200 --seed 0 --out repro.py
    result = fuzz(adapter, dist, examples=50, seed=0)   # in your own multi-rank test
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
