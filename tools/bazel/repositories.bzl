"""Workspace setup for tfpolicy's Bazel rules: runs offline, fetches nothing.

    load("@tfpolicy//tools/bazel:repositories.bzl", "tfpolicy_dependencies")
    tfpolicy_dependencies()

declares, unless the workspace already has them:

    @rules_cc, @rules_java      stubs whose macros forward to Bazel's native rules
                                (Bazel 4 loads them for any py_test and would
                                download them otherwise)
    @remote_coverage_tools      two targets that exit 1 (`bazel coverage` is off)
    @tfpolicy_python            a py_runtime on the interpreter that has
                                TensorFlow, registered as the Python toolchain

The interpreter is the first of: $BAZEL_PYTHON; `.venv/bin/python` in the main
workspace; `.venv/bin/python` in tfpolicy's checkout; `python3` on PATH. The
repository fails, naming the interpreter and what it lacks, when a module of
`required_modules` cannot be found.
"""

_CC_RULES = [
    "cc_binary",
    "cc_import",
    "cc_library",
    "cc_proto_library",
    "cc_shared_library",
    "cc_test",
    "cc_toolchain",
    "cc_toolchain_suite",
    "fdo_prefetch_hints",
    "fdo_profile",
    "objc_import",
    "objc_library",
]

_JAVA_RULES = [
    "java_binary",
    "java_import",
    "java_library",
    "java_lite_proto_library",
    "java_package_configuration",
    "java_plugin",
    "java_proto_library",
    "java_runtime",
    "java_test",
    "java_toolchain",
]

def _forwarding_defs(rules):
    """A .bzl file defining each rule of `rules` as a call of `native.<rule>`."""
    return "\n".join([
        "def {0}(**kwargs):\n    native.{0}(**kwargs)\n".format(rule)
        for rule in rules
    ])

_STUB_HEADER = "# Written by tfpolicy's tools/bazel/repositories.bzl: an offline stand-in.\n"

def _stub_repository_impl(repository_ctx):
    repository_ctx.file("WORKSPACE", _STUB_HEADER + 'workspace(name = "{}")\n'.format(repository_ctx.name))
    for path, content in repository_ctx.attr.files.items():
        header = "" if content.startswith("#!") else _STUB_HEADER
        repository_ctx.file(path, header + content, executable = path.endswith(".sh"))

_stub_repository = repository_rule(
    implementation = _stub_repository_impl,
    attrs = {"files": attr.string_dict(mandatory = True)},
    doc = "A repository made of the given {path: content} files.",
)

_COVERAGE_BUILD = """
[sh_binary(
    name = name,
    srcs = ["unavailable.sh"],
    visibility = ["//visibility:public"],
) for name in ["coverage_report_generator", "lcov_merger"]]
"""

_COVERAGE_SCRIPT = """#!/bin/sh
echo "bazel coverage is not available in this offline workspace" >&2
exit 1
"""

def _python_candidates(repository_ctx):
    """(interpreter, where it came from) pairs, in order of preference."""
    explicit = repository_ctx.os.environ.get("BAZEL_PYTHON", "")
    if explicit:
        return [(explicit, "$BAZEL_PYTHON")]
    candidates = []
    roots = [
        ("the main workspace", Label("@//:WORKSPACE")),
        ("tfpolicy's checkout", Label("//:WORKSPACE")),
    ]
    for where, label in roots:
        root = repository_ctx.path(label).dirname.realpath  # not external/<name>
        venv_python = "{}/.venv/bin/python".format(root)
        if repository_ctx.path(venv_python).exists:
            candidates.append((venv_python, ".venv of " + where))
    python3 = repository_ctx.which("python3")
    if python3:
        candidates.append((str(python3), "python3 on PATH"))
    return candidates

_CHECK_MODULES = """
import importlib.util, sys
missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]
print(" ".join(missing))
"""

def _python_toolchain_impl(repository_ctx):
    candidates = _python_candidates(repository_ctx)
    if not candidates:
        fail("tfpolicy: error: no Python interpreter: set BAZEL_PYTHON, create .venv, or put python3 on PATH")
    python, where = candidates[0]
    if python.startswith("/") and not repository_ctx.path(python).exists:
        fail("tfpolicy: error: Python interpreter '{}' (from {}) does not exist".format(python, where))
    result = repository_ctx.execute([python, "-c", _CHECK_MODULES] + repository_ctx.attr.required_modules)
    if result.return_code != 0:
        fail("tfpolicy: error: Python interpreter '{}' (from {}) does not run: {}".format(
            python,
            where,
            result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "exit status {}".format(result.return_code),
        ))
    missing = result.stdout.strip()
    if missing:
        fail("tfpolicy: error: Python interpreter '{}' (from {}) lacks {}; ".format(python, where, missing) +
             "install the project into it (pip install -e '.[test]') or set BAZEL_PYTHON")

    # A long or spaced path cannot be a shebang; the stub then finds any python3.
    shebang = "#!" + python if len(python) < 120 and " " not in python else "#!/usr/bin/env python3"
    repository_ctx.file("WORKSPACE", 'workspace(name = "{}")\n'.format(repository_ctx.name))
    repository_ctx.file("BUILD", """# The Python toolchain tfpolicy's repositories.bzl chose: {where}.
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "python3",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "{shebang}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":python3",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(where = where, python = python, shebang = shebang))

python_toolchain_repository = repository_rule(
    implementation = _python_toolchain_impl,
    attrs = {
        "required_modules": attr.string_list(
            default = ["numpy", "tensorflow", "keras", "absl"],
            doc = "Modules the chosen interpreter must be able to import.",
        ),
    },
    environ = ["BAZEL_PYTHON"],
    local = True,
    doc = "A py_runtime toolchain on $BAZEL_PYTHON, else a .venv, else python3.",
)

def tfpolicy_dependencies(required_modules = None):
    """Declares the stub repositories and registers tfpolicy's Python toolchain.

    Args:
      required_modules: modules the interpreter must import; the default is what
        the tfpolicy_rewrite and tfpolicy_test rules need.
    """
    if not native.existing_rule("rules_cc"):
        _stub_repository(name = "rules_cc", files = {
            "BUILD": "",
            "cc/BUILD": "",
            "cc/defs.bzl": _forwarding_defs(_CC_RULES),
        })
    if not native.existing_rule("rules_java"):
        _stub_repository(name = "rules_java", files = {
            "BUILD": "",
            "java/BUILD": "",
            "java/defs.bzl": _forwarding_defs(_JAVA_RULES),
        })
    if not native.existing_rule("remote_coverage_tools"):
        _stub_repository(name = "remote_coverage_tools", files = {
            "BUILD": _COVERAGE_BUILD,
            "unavailable.sh": _COVERAGE_SCRIPT,
        })
    if not native.existing_rule("tfpolicy_python"):
        kwargs = {} if required_modules == None else {"required_modules": required_modules}
        python_toolchain_repository(name = "tfpolicy_python", **kwargs)
    native.register_toolchains("@tfpolicy_python//:toolchain")
