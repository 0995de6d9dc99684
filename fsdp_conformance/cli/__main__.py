"""``python -m fsdp_conformance.cli``: the same as the ``fsdp-conformance`` console script."""

from __future__ import annotations

import sys

from fsdp_conformance.cli import main

sys.exit(main())
