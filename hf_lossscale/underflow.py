"""Moved to `hf_lossscale.fp16.underflow`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.fp16 import underflow as _moved

sys.modules[__name__] = _moved
