"""Typed errors.

Every error a user can cause (a bad map, a missing SavedModel, an existing
output) is a :class:`TfPolicyError`. The CLI prints ``str(error)`` as one line
and exits non-zero; the Python API lets it propagate. Anything else that escapes
is a bug in tfpolicy and keeps its traceback.
"""

from __future__ import annotations


class TfPolicyError(Exception):
    """Base class of every user-facing error. ``str()`` is one complete line."""


class PolicyMapError(TfPolicyError):
    """The policy map cannot be read, parsed or validated."""


class AmbiguousPathError(PolicyMapError):
    """A layer path matches more than one regex key of the policy map."""


class UnsupportedPolicyError(TfPolicyError):
    """A policy Keras accepts but this version of tfpolicy cannot apply yet."""


class SavedModelError(TfPolicyError):
    """The input is missing, is not a SavedModel, or lacks what was asked for."""


class OutputError(TfPolicyError):
    """The output location is refused (exists, equals or lies inside the input)."""


class InputDataError(TfPolicyError):
    """Calibration or validation data is missing, unreadable or does not fit a signature."""


class StrictModeError(TfPolicyError):
    """A warning that ``strict=True`` turns into an error (e.g. an unused key)."""


class PassError(Exception):
    """An internal rewrite pass failed; carries the pass name. Not a user error."""

    def __init__(self, pass_name: str, message: str) -> None:
        super().__init__(f"pass '{pass_name}' failed: {message}")
        self.pass_name = pass_name
