"""tfpolicy: apply a Keras DTypePolicyMap to a TensorFlow SavedModel.

    import tfpolicy
    report = tfpolicy.rewrite("model/", "model_bf16/", {"default_policy": "mixed_bfloat16"})

Names are imported lazily, so that ``python -m tfpolicy.rewrite`` can quiet
TensorFlow's C++ logging before TensorFlow is first imported.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "rewrite": "tfpolicy.api",
    "explain": "tfpolicy.api",
    "PolicyMap": "tfpolicy.analysis.policy_map",
    "Report": "tfpolicy.report",
    "TfPolicyError": "tfpolicy.errors",
    "PolicyMapError": "tfpolicy.errors",
    "AmbiguousPathError": "tfpolicy.errors",
    "UnsupportedPolicyError": "tfpolicy.errors",
    "SavedModelError": "tfpolicy.errors",
    "OutputError": "tfpolicy.errors",
    "StrictModeError": "tfpolicy.errors",
    "InputDataError": "tfpolicy.errors",
    "TargetError": "tfpolicy.errors",
    "ServingCheckError": "tfpolicy.errors",
    "ValidationError": "tfpolicy.errors",
    "validate": "tfpolicy.validation.compare",
    "export": "tfpolicy.serving_export",
    "export_with_report": "tfpolicy.serving_export",
    "suggest": "tfpolicy.suggestion",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfpolicy' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
