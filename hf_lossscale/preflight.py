"""Moved to `hf_lossscale.fp16.preflight`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.fp16 import preflight as _moved

sys.modules[__name__] = _moved
