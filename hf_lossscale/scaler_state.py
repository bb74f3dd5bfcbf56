"""Moved to `hf_lossscale.core.scaler_state`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.core import scaler_state as _moved

sys.modules[__name__] = _moved
