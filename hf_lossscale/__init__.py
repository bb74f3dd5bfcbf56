"""hf_lossscale: configurable, observable loss scaling for FP16 training with Hugging Face tools.

`import hf_lossscale` imports only torch; the Accelerate and Trainer integrations load
transformers/accelerate when first used.
"""

from .config import LossScaleConfig
from .scaler import DynamicLossScaler, LossScaleCollapseError

__version__ = "0.1.0"

__all__ = ["DynamicLossScaler", "LossScaleCollapseError", "LossScaleConfig", "__version__"]
