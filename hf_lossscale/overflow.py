"""Moved to `hf_lossscale.core.overflow`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.core import overflow as _moved

sys.modules[__name__] = _moved
