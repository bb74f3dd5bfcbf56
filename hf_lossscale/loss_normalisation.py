"""Moved to `hf_lossscale.integrations.loss_normalisation`; this path stays for one release: importing it gives that module."""

import sys

from hf_lossscale.integrations import loss_normalisation as _moved

sys.modules[__name__] = _moved
