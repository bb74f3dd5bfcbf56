"""Moved to `hf_lossscale.integrations.accelerate_hook`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.integrations import accelerate_hook as _moved

sys.modules[__name__] = _moved
