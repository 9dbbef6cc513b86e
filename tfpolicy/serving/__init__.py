"""Serving: the output as TF Serving and XLA will take it.

Takes a written SavedModel; gives the serving checks every rewrite runs
before its output is renamed into place (TF1 session loader, XLA lowering).

    checks          the serving checks
    device_kernels  --target gpu: every op left outside XLA has a GPU kernel

(The versioned export step for TF Serving, an entry point above the API, is
:mod:`tfpolicy.serving_export`.)
"""
