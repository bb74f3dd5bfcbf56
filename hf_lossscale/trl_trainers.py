"""Moved to `hf_lossscale.integrations.trl_trainers`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.integrations import trl_trainers as _moved

sys.modules[__name__] = _moved
