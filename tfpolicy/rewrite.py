"""``python -m tfpolicy.rewrite``: the command line, which lives in :mod:`tfpolicy.cli`.

Python code calls the API, :func:`tfpolicy.rewrite` (``tfpolicy.api.rewrite``).
Run as a script, this module does not bind the package attribute
``tfpolicy.rewrite``; importing it explicitly would (Python's rule for
submodules), so nothing in tfpolicy does.
"""

from absl import flags

from tfpolicy import cli
from tfpolicy.cli import run_main

flags.adopt_module_key_flags(cli)  # --helpshort lists the command's flags
__doc__ = cli.__doc__  # ... under its usage text (absl prints the main module's docstring)

if __name__ == "__main__":
    run_main()
