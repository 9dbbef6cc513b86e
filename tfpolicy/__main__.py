"""``python -m tfpolicy``: the command line (:mod:`tfpolicy.cli`)."""

from absl import flags

from tfpolicy import cli
from tfpolicy.cli import run_main

flags.adopt_module_key_flags(cli)  # --helpshort lists the command's flags
__doc__ = cli.__doc__  # ... under its usage text (absl prints the main module's docstring)

run_main()
