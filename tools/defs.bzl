"""Bazel rules that apply a tfpolicy policy map to a SavedModel.

    load("@tfpolicy//tools:defs.bzl", "tfpolicy_rewrite", "tfpolicy_test")

    tfpolicy_rewrite(
        name = "model_bf16",                 # output: the directory model_bf16/
        saved_model = ":model",              # a filegroup of the SavedModel's files
        policy_map = "policy.json",
    )

    tfpolicy_test(
        name = "model_bf16_test",            # rewrites, then compares with the input
        saved_model = ":model",
        policy_map = "policy.json",
        max_error = 0.05,                    # max abs error over every signature output
    )

The workspace needs `tfpolicy_dependencies()` from
`@tfpolicy//tools/bazel:repositories.bzl` (stubs and the Python toolchain).
"""

def _saved_model_dir(files, label):
    """The directory to hand tfpolicy for a `saved_model` attribute's files.

    A directory output (e.g. another tfpolicy_rewrite's) is used as is; a
    filegroup gives the directory of its saved_model.pb. Anything else is passed
    on unchanged, so that tfpolicy's own one-line error names what is wrong.
    """
    for f in files:
        if f.is_directory:
            return f.path
    for f in files:
        if f.basename == "saved_model.pb":
            return f.dirname
    if files:
        return files[0].dirname
    parts = [p for p in [label.workspace_root, label.package, label.name] if p]
    return "/".join(parts)

def _tfpolicy_rewrite_impl(ctx):
    saved_model = ctx.files.saved_model
    output = ctx.actions.declare_directory(ctx.label.name)
    args = ctx.actions.args()
    args.add("--map", ctx.file.policy_map)
    inputs = saved_model + [ctx.file.policy_map]
    if ctx.file.calibration_data:
        args.add("--calibration_data", ctx.file.calibration_data)
        inputs.append(ctx.file.calibration_data)
    if ctx.attr.target:
        args.add("--target", ctx.attr.target)
    if ctx.attr.int8_convolutions:
        args.add("--int8_convolutions")
    args.add_all(["--overwrite", "--quiet"])  # Bazel creates the output directory first
    args.add(_saved_model_dir(saved_model, ctx.attr.saved_model.label))
    args.add(output.path)
    ctx.actions.run(
        executable = ctx.executable._rewrite,
        arguments = [args],
        inputs = inputs,
        outputs = [output],
        mnemonic = "TfPolicyRewrite",
        progress_message = "tfpolicy: rewriting %s" % ctx.label,
        env = {"TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    return [DefaultInfo(files = depset([output]), runfiles = ctx.runfiles(files = [output]))]

tfpolicy_rewrite = rule(
    implementation = _tfpolicy_rewrite_impl,
    doc = "Rewrites a SavedModel with a policy map; the output is the directory <name>/.",
    attrs = {
        "saved_model": attr.label(
            mandatory = True,
            allow_files = True,
            doc = "The input SavedModel: a filegroup of its files, or a rule's directory output.",
        ),
        "policy_map": attr.label(
            mandatory = True,
            allow_single_file = [".json"],
            doc = "The policy map JSON file.",
        ),
        "calibration_data": attr.label(
            allow_single_file = [".npz"],
            doc = "Optional calibration batches, passed as --calibration_data.",
        ),
        "target": attr.string(
            values = ["", "gpu", "tpu", "cpu"],
            doc = "The serving target, passed as --target: \"tpu\" refuses float16 and float8 and" +
                  " fails the build when a signature does not compile under XLA.",
        ),
        "int8_convolutions": attr.bool(
            default = False,
            doc = "Also store the convolution kernels of int8 layers in int8 (--int8_convolutions);" +
                  " Keras leaves them in the source policy.",
        ),
        "_rewrite": attr.label(
            default = Label("//tools/bazel:rewrite"),
            executable = True,
            cfg = "exec",
        ),
    },
)

def tfpolicy_test(
        name,
        saved_model,
        policy_map,
        max_error,
        calibration_data = None,
        validation_data = None,
        seed = 0,
        target = None,
        int8_convolutions = False,
        **kwargs):
    """A test that rewrites `saved_model` and validates the result against it.

    The check is `tfpolicy.validate`, as `python -m tfpolicy.rewrite --validate`
    runs it: every signature of both SavedModels on the same inputs (the
    validation data, else generated inputs seeded with `seed`); the test fails
    when the largest absolute difference of any output exceeds `max_error`.

    Args:
      name: the test's name; the rewritten model is the target <name>_rewritten.
      saved_model: the input SavedModel, as for tfpolicy_rewrite.
      policy_map: the policy map JSON file.
      max_error: the bound on the max abs error, a number.
      calibration_data: optional, as for tfpolicy_rewrite.
      validation_data: optional .npz of inputs keyed by input name, batch first.
      seed: seed of the generated inputs.
      target: optional serving target, as for tfpolicy_rewrite.
      int8_convolutions: as for tfpolicy_rewrite.
      **kwargs: passed to the py_test (size, tags, timeout, ...).
    """
    rewritten = name + "_rewritten"
    tfpolicy_rewrite(
        name = rewritten,
        saved_model = saved_model,
        policy_map = policy_map,
        calibration_data = calibration_data,
        target = target or "",
        int8_convolutions = int8_convolutions,
        testonly = True,
        tags = kwargs.get("tags", []),
        visibility = ["//visibility:private"],
    )
    compare = str(Label("//tools/bazel:compare.py"))
    native.py_test(
        name = name,
        srcs = [compare],
        main = compare,
        deps = [str(Label("//:tfpolicy"))],
        data = [saved_model, ":" + rewritten] + ([validation_data] if validation_data else []),
        args = [
            "--max_error=%s" % max_error,
            "--seed=%d" % seed,
            "--rewritten=$(rootpath :%s)" % rewritten,
        ] + (["--validation_data=$(rootpath %s)" % validation_data] if validation_data else []) + [
            "--saved_model",
            "$(rootpaths %s)" % saved_model,
        ],
        python_version = "PY3",
        legacy_create_init = False,  # else runfiles/tfpolicy/__init__.py shadows the package
        **kwargs
    )
