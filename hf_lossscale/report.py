"""Moved to `hf_lossscale.tools.report`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.tools import report as _moved

sys.modules[__name__] = _moved
