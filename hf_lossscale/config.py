"""Moved to `hf_lossscale.core.config`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.core import config as _moved

sys.modules[__name__] = _moved
