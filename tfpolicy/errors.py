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
    """Calibration, validation or warmup data is missing, unreadable or does not fit
    a signature: a missing or non-npz file, object arrays, a missing or extra input
    name, a wrong dtype or shape."""


class StrictModeError(TfPolicyError):
    """A warning that ``strict=True`` turns into an error (e.g. an unused key)."""


class TargetError(TfPolicyError):
    """The policy map uses a dtype the serving target (``--target``) cannot run."""


class ServingCheckError(TfPolicyError):
    """The rewritten model fails a serving check it must pass (the TF1 session
    loader, or XLA compilation for a TPU target); nothing is written."""


class ValidationError(TfPolicyError):
    """An output's error exceeds ``max_error``; ``validation`` holds the report.

    Not a usage error: the CLI prints the validation table and exits 1.
    """

    def __init__(self, message: str, validation: object, report: object = None) -> None:
        super().__init__(message)
        self.validation = validation
        self.report = report


class MissingDependencyError(TfPolicyError):
    """An optional package a feature needs is not installed (names the extra)."""


class PassError(Exception):
    """An internal rewrite pass failed; carries the pass name. Not a user error."""

    def __init__(self, pass_name: str, message: str) -> None:
        super().__init__(f"pass '{pass_name}' failed: {message}")
        self.pass_name = pass_name


def exception_line(exc: BaseException) -> str:
    """An exception as one line: :func:`cause_line` of its message, or its type's name when it has none."""
    text = str(exc).strip()
    return cause_line(text) if text else type(exc).__name__


MAX_LINE = 400


def one_line(exc_or_text: object) -> str:
    """Any text (a Keras message over several lines) squeezed onto one line, cut at :data:`MAX_LINE`."""
    text = " ".join(str(exc_or_text).split())
    if len(text) > MAX_LINE:
        text = text[: MAX_LINE - 3] + "..."
    return text


_BOILERPLATE = ("Graph execution error", "Detected at node", "Exception encountered when calling", "Stack trace",
                "<stack traces unavailable>")


def cause_line(text: str) -> str:
    """TensorFlow's first line of cause in an error message, with the node it names.

    ``"Graph execution error:\\n\\nDetected at node 'G' defined at ...\\n    File ...\\n
    Node: 'G'\\nindices[0] = 5 is not in [0, 2)\\n\\t [[{{node G}}]]"`` becomes
    ``"indices[0] = 5 is not in [0, 2) (node 'G')"``: the summary lines, the
    Python stack and the bracketed node repeat are dropped.
    """
    node = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or raw[:1].isspace() or line.startswith(_BOILERPLATE) or line.startswith("[["):
            continue
        if line.startswith("Node: "):
            node = line[len("Node: ") :]
            continue
        return f"{line} (node {node})" if node else line
    stripped = text.strip()
    return stripped.splitlines()[0] if stripped else "unknown error"
