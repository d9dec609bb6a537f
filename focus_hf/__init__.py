"""focus_hf: Focus learned sparse attention as a PEFT adapter for Hugging Face transformers.

Importing the package registers the FOCUS adapter type with PEFT and the `focus` attention function with
transformers, so `get_peft_model`, `PeftModel.from_pretrained` and `model.load_adapter` accept Focus adapters.
"""

from .registration import register

register()

from .api import group_assignments, set_routing  # noqa: E402
from .config import FocusConfig, FocusConfigError  # noqa: E402
from .model import FocusModel  # noqa: E402

__version__ = "0.1.0"

__all__ = ["FocusConfig", "FocusConfigError", "FocusModel", "group_assignments", "set_routing", "__version__"]
