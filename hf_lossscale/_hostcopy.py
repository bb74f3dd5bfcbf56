"""Moved to `hf_lossscale.core.hostcopy`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.core import hostcopy as _moved

sys.modules[__name__] = _moved
