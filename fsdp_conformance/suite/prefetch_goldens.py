"""Prefetch-order goldens per adapter (``BasePrefetchOrderTests.test_trace_matches_golden``).

Each golden is the rendered ``CommTrace`` (``fsdp_conformance.observe.comm_trace``) of three
FULL_SHARD iterations of one zoo model and one prefetch setting, world size 2, CPU/gloo: one
line per all-gather, free, gradient reduction and compute start, ``op label state``. They pin the
exact order of one implementation: ``impl`` (this repository), ``torch-fsdp1`` and
``torch-fsdp2`` (both written against torch 2.13.0; other torch versions skip). Other adapters have no goldens and skip; their
prefetch is held to the structural check ``test_prefetch_happens`` instead.

Regenerate after an intended change (one process, so that one writer edits this file; ranks
other than 0 do not write)::

    EXPECTTEST_ACCEPT=1 pytest -p no:xdist --pyargs fsdp_conformance.suite.test_prefetch_order \
        -k golden --fsdp-impl impl          # and again with torch-fsdp1, torch-fsdp2
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

# The torch release the torch-fsdp1 goldens were recorded with
TORCH_FSDP1_GOLDEN_VERSION = "2.13."
# The torch release the torch-fsdp2 goldens were recorded with
TORCH_FSDP2_GOLDEN_VERSION = "2.13."


def expect(actual: str, golden: str) -> None:
    """``assert_expected_inline`` for the literal at the caller's call site."""
    assert_expected_inline(actual, golden, skip=1)


def check_golden(adapter_name: str, case: str, rendered: str) -> None:
    """Compare ``rendered`` with the golden of ``adapter_name`` and ``case`` (or skip)."""
    if adapter_name == "impl":
        impl_golden(case, rendered)
    elif adapter_name == "torch-fsdp1":
        if not torch.__version__.startswith(TORCH_FSDP1_GOLDEN_VERSION):
            pytest.skip(
                f"adapter 'torch-fsdp1': the prefetch-order goldens were recorded with torch "
                f"{TORCH_FSDP1_GOLDEN_VERSION}x, this is torch {torch.__version__}"
            )
        torch_fsdp1_golden(case, rendered)
    elif adapter_name == "torch-fsdp2":
        if not torch.__version__.startswith(TORCH_FSDP2_GOLDEN_VERSION):
            pytest.skip(
                f"adapter 'torch-fsdp2': the prefetch-order goldens were recorded with torch "
                f"{TORCH_FSDP2_GOLDEN_VERSION}x, this is torch {torch.__version__}"
            )
        torch_fsdp2_golden(case, rendered)
    else:
        pytest.skip(
            f"adapter {adapter_name!r} has no prefetch-order goldens (they are implementation-"
            "specific); override BasePrefetchOrderTests.check_golden with your own"
        )


# The goldens keep expecttest's own layout (EXPECTTEST_ACCEPT rewrites them in place)
# fmt: off
def impl_golden(case: str, rendered: str) -> None:
    if case == "nested-bwd=None-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=None-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 IDLE
  compute <root> FORWARD
  all_gather module.1.0 IDLE
  compute module.1 FORWARD
  all_gather module.2 IDLE
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_PRE-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 IDLE
  all_gather module.1 IDLE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1.0 IDLE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_PRE-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 IDLE
  all_gather module.1 IDLE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1.0 IDLE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 IDLE
  compute <root> FORWARD
  all_gather module.1.0 IDLE
  compute module.1 FORWARD
  all_gather module.2 IDLE
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_POST-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1 IDLE
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_POST-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1 IDLE
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 IDLE
  compute <root> FORWARD
  all_gather module.1.0 IDLE
  compute module.1 FORWARD
  all_gather module.2 IDLE
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=None-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=None-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 IDLE
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 IDLE
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 IDLE
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 IDLE
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_PRE-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 IDLE
  all_gather transformer.decoder.layers.0 IDLE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 IDLE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 IDLE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_PRE-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 IDLE
  all_gather transformer.decoder.layers.0 IDLE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 IDLE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 IDLE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 IDLE
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 IDLE
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 IDLE
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 IDLE
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_POST-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 IDLE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 IDLE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  free transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 IDLE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_POST-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 IDLE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 IDLE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  free transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 IDLE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 IDLE
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 IDLE
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 IDLE
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 IDLE
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    else:
        raise ValueError(f"no golden for case {case!r}")


def torch_fsdp1_golden(case: str, rendered: str) -> None:
    if case == "nested-bwd=None-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=None-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 FORWARD
  compute <root> FORWARD
  all_gather module.1.0 FORWARD
  compute module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 2 backward
""")
    elif case == "nested-bwd=BACKWARD_PRE-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_PRE-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 FORWARD
  compute <root> FORWARD
  all_gather module.1.0 FORWARD
  compute module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 2 backward
""")
    elif case == "nested-bwd=BACKWARD_POST-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1 BACKWARD_PRE
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_POST-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1 BACKWARD_PRE
  reduce_scatter module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 FORWARD
  compute <root> FORWARD
  all_gather module.1.0 FORWARD
  compute module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  free module.2 BACKWARD_POST
  reduce_scatter module.2 BACKWARD_POST
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1.0 BACKWARD_POST
  free module.1 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 2 backward
""")
    elif case == "transformer-bwd=None-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=None-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 2 backward
""")
    elif case == "transformer-bwd=BACKWARD_PRE-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_PRE-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 2 backward
""")
    elif case == "transformer-bwd=BACKWARD_POST-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  free transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_POST-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  free transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.1 BACKWARD_POST
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_POST
  free <root> BACKWARD_POST
  reduce_scatter <root> BACKWARD_POST
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 2 backward
""")
    else:
        raise ValueError(f"no golden for case {case!r}")


def torch_fsdp2_golden(case: str, rendered: str) -> None:
    if case == "nested-bwd=None-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  reduce_scatter module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  reduce_scatter module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_PRE
  free module.1 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=None-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  reduce_scatter module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1 BACKWARD_PRE
  all_gather module.1.0 BACKWARD_PRE
  reduce_scatter module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_PRE
  free module.1 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 FORWARD
  compute <root> FORWARD
  all_gather module.1.0 FORWARD
  compute module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_PRE-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  reduce_scatter module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  reduce_scatter module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_PRE
  free module.1 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_PRE-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  reduce_scatter module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  reduce_scatter module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_PRE
  free module.1 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 FORWARD
  compute <root> FORWARD
  all_gather module.1.0 FORWARD
  compute module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_POST-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  reduce_scatter module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  reduce_scatter module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_PRE
  free module.1 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "nested-bwd=BACKWARD_POST-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather module.1 FORWARD
  compute module.1 FORWARD
  all_gather module.1.0 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 1 backward:
  all_gather module.2 BACKWARD_PRE
  all_gather module.1 BACKWARD_PRE
  reduce_scatter module.2 BACKWARD_PRE
  free module.2 BACKWARD_POST
  all_gather module.1.0 BACKWARD_PRE
  reduce_scatter module.1.0 BACKWARD_PRE
  free module.1.0 BACKWARD_POST
  reduce_scatter module.1 BACKWARD_PRE
  free module.1 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather module.1 FORWARD
  compute <root> FORWARD
  all_gather module.1.0 FORWARD
  compute module.1 FORWARD
  all_gather module.2 FORWARD
  compute module.1.0 FORWARD
  free module.1.0 FORWARD
  free module.1 FORWARD
  compute module.2 FORWARD
  free module.2 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=None-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=None-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_PRE-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_PRE-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_POST-fwd=0":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward: same as iteration 1 forward
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 1 forward
iteration 3 backward: same as iteration 1 backward
""")
    elif case == "transformer-bwd=BACKWARD_POST-fwd=1":
        expect(rendered, """\
iteration 1 forward:
  all_gather <root> FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 1 backward:
  all_gather transformer.decoder.layers.1 BACKWARD_PRE
  all_gather transformer.decoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.1 BACKWARD_PRE
  free transformer.decoder.layers.1 BACKWARD_POST
  all_gather transformer.encoder.layers.1 BACKWARD_PRE
  reduce_scatter transformer.decoder.layers.0 BACKWARD_PRE
  free transformer.decoder.layers.0 BACKWARD_POST
  all_gather transformer.encoder.layers.0 BACKWARD_PRE
  reduce_scatter transformer.encoder.layers.1 BACKWARD_PRE
  free transformer.encoder.layers.1 BACKWARD_POST
  reduce_scatter transformer.encoder.layers.0 BACKWARD_PRE
  free transformer.encoder.layers.0 BACKWARD_POST
  reduce_scatter <root> BACKWARD_PRE
  free <root> BACKWARD_POST
iteration 2 forward:
  all_gather <root> FORWARD
  all_gather transformer.encoder.layers.0 FORWARD
  compute <root> FORWARD
  all_gather transformer.encoder.layers.1 FORWARD
  compute transformer.encoder.layers.0 FORWARD
  free transformer.encoder.layers.0 FORWARD
  all_gather transformer.decoder.layers.0 FORWARD
  compute transformer.encoder.layers.1 FORWARD
  free transformer.encoder.layers.1 FORWARD
  all_gather transformer.decoder.layers.1 FORWARD
  compute transformer.decoder.layers.0 FORWARD
  free transformer.decoder.layers.0 FORWARD
  compute transformer.decoder.layers.1 FORWARD
  free transformer.decoder.layers.1 FORWARD
iteration 2 backward: same as iteration 1 backward
iteration 3 forward: same as iteration 2 forward
iteration 3 backward: same as iteration 1 backward
""")
    else:
        raise ValueError(f"no golden for case {case!r}")
# fmt: on
