"""Serving: the output as TF Serving and XLA will take it.

Takes a written SavedModel; gives a TF Serving version directory
(``--serving_base``) and the serving checks every rewrite runs before its
output is renamed into place (TF1 session loader, XLA lowering, target dtypes).

    export   the versioned export step for TF Serving
    checks   the serving checks and --target rules
"""
