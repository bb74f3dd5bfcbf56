"""Moved to `hf_lossscale.core.scaler`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.core import scaler as _moved

sys.modules[__name__] = _moved
