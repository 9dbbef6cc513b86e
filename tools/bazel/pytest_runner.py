"""Runs pytest on the files given as arguments, inside a Bazel test's runfiles.

    pytest_runner.py tests/test_units.py [pytest options]

Bazel gives the test a private temporary directory ($TEST_TMPDIR) and asks for
a JUnit XML report at $XML_OUTPUT_FILE; pytest's temporary files, its report and
Hypothesis's example database go there, and nothing is written to the runfiles.
The exit status is pytest's, so any failed or erroring test fails the target.
"""

from __future__ import annotations

import os
import sys


def pytest_args(argv: list[str], environ: dict[str, str]) -> list[str]:
    """pytest's arguments for a run under ``bazel test``."""
    args = list(argv) + ["-p", "no:cacheprovider", "-q"]
    if environ.get("XML_OUTPUT_FILE"):
        args.append("--junitxml=" + environ["XML_OUTPUT_FILE"])
    if environ.get("TEST_TMPDIR"):
        args.append("--basetemp=" + os.path.join(environ["TEST_TMPDIR"], "pytest"))
    return args


def main(argv: list[str]) -> int:
    if os.environ.get("TEST_TMPDIR"):
        # Read when Hypothesis is imported, i.e. when pytest loads its plugin.
        os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(os.environ["TEST_TMPDIR"], "hypothesis"))
    import pytest

    return int(pytest.main(pytest_args(argv, dict(os.environ))))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
