"""The core: tfpolicy's graph IR and the SavedModel boundary.

Takes a SavedModel directory; gives each signature as a :class:`~tfpolicy.core.graph.Graph`
(plus the functions it calls and the variables it captures), and, after the
passes, builds the new SavedModel from the rewritten graphs. The only stage
that reads or writes protobufs and TensorFlow's SavedModel machinery;
TensorFlow's private APIs live in :mod:`tfpolicy.core.tf_internals` alone.

    savedmodel_io   load a SavedModel into graphs
    savedmodel_save rebuild concrete functions from the graphs; save atomically
    tf1_saver       the output's TF1 saver (restore and save ops), written as nodes
    graph           the graph view: nodes, use-def, edits, verify()
    tf_names        TensorFlow's edge-name and dtype-attribute rules
    assemble        the output's root object: variables, signatures, tfpolicy.calibrate
    tf_internals    every tensorflow.python import, each with why
    checkpoints     the output's variable values, written as the save runs
    inputs          reading .npz / dict / tf.data inputs, checking them against a signature
    keras_internals every private Keras piece, each with why
    paths           the input, output and report paths, checked before any work (no TensorFlow)
    staging         staging directories: stale ones removed, published by rename, interrupts held
"""
