"""Moved to `hf_lossscale.tools.files`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.tools import files as _moved

sys.modules[__name__] = _moved
