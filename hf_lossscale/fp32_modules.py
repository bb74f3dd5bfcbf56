"""Moved to `hf_lossscale.fp16.fp32_modules`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.fp16 import fp32_modules as _moved

sys.modules[__name__] = _moved
