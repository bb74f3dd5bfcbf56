"""Moved to `hf_lossscale.integrations.trainer`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.integrations import trainer as _moved

sys.modules[__name__] = _moved
