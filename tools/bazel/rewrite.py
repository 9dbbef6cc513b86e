"""``python -m tfpolicy.rewrite`` as a Bazel binary: the tfpolicy_rewrite rule's action."""

import runpy

if __name__ == "__main__":
    runpy.run_module("tfpolicy.rewrite", run_name="__main__", alter_sys=True)
