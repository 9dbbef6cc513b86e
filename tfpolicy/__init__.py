"""tfpolicy: apply a Keras DTypePolicyMap to a TensorFlow SavedModel.

    import tfpolicy
    report = tfpolicy.rewrite("model/", "model_bf16/", {"default_policy": "mixed_bfloat16"})
"""

from tfpolicy.api import explain, rewrite
from tfpolicy.errors import (
    AmbiguousPathError,
    OutputError,
    PolicyMapError,
    SavedModelError,
    StrictModeError,
    TfPolicyError,
    UnsupportedPolicyError,
)
from tfpolicy.policy_map import PolicyMap
from tfpolicy.report import Report

__version__ = "0.1.0"

__all__ = [
    "AmbiguousPathError",
    "OutputError",
    "PolicyMap",
    "PolicyMapError",
    "Report",
    "SavedModelError",
    "StrictModeError",
    "TfPolicyError",
    "UnsupportedPolicyError",
    "explain",
    "rewrite",
    "__version__",
]
