"""Validation: the rewritten model measured against the input model.

Takes the input and output SavedModels and input batches (given or
generated); gives per-output errors, per-layer errors and an HTML report.

    compare        run both models on the same inputs; errors per output (--validate)
    layer_errors   each layer's own error, the float model's tensors fed to the rewritten one
    html_report    the report as one HTML page

(Reading inputs, .npz / dict / tf.data, is :mod:`tfpolicy.core.inputs`, shared with
calibration and the export step.)
"""
