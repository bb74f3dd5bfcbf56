"""Where the tests find the benchmark data (`../shared/data` in CI; see its README).

`HF_LOSSSCALE_DATA` names the folder (default: `shared/data` beside the repository). A test that
reads it carries `@needs_data`: on a clone with nothing beside it, it is skipped with a reason that
names the variable; with `HF_LOSSSCALE_REQUIRE_DATA=1` (what `.ci/run` sets) a missing folder
fails it instead, so CI cannot silently stop running them.
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HF_LOSSSCALE_DATA") or ROOT.parent / "shared" / "data")
REQUIRED = os.environ.get("HF_LOSSSCALE_REQUIRE_DATA") == "1"

needs_data = pytest.mark.skipif(
    not DATA.is_dir() and not REQUIRED,
    reason=f"benchmark data not found at {DATA}: set HF_LOSSSCALE_DATA to the shared/data folder "
    "(CI sets HF_LOSSSCALE_REQUIRE_DATA=1, which fails these tests instead of skipping them)",
)
