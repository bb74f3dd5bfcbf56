"""Moved to `hf_lossscale.recipes.recipe_args` (the recipes' shared arguments and data loading);
this file stays for scripts copied from an earlier release that `import recipe_args`."""

import sys

from hf_lossscale.recipes import recipe_args as _moved

sys.modules[__name__] = _moved
