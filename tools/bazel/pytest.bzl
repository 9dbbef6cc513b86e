"""pytest files as Bazel test targets.

    load("//tools/bazel:pytest.bzl", "pytest_test")

    pytest_test(
        name = "test_units",
        tests = ["test_units.py"],
        support = ["conftest.py", "model_zoo.py"],
    )

is a py_test whose main is tools/bazel/pytest_runner.py; it runs pytest on
`tests` inside the runfiles tree, so every conftest.py, helper module and data
file a test reads must be in `support` or `data`.
"""

def pytest_test(name, tests, support = [], deps = [], data = [], args = [], **kwargs):
    """A py_test running pytest on `tests` (its exit status is pytest's)."""
    runner = str(Label("//tools/bazel:pytest_runner.py"))
    native.py_test(
        name = name,
        srcs = tests + support + [runner],
        main = runner,
        deps = deps,
        data = data,
        args = ["$(rootpath %s)" % test for test in tests] + args,
        python_version = "PY3",
        legacy_create_init = False,  # else runfiles/tfpolicy/__init__.py shadows the package
        **kwargs
    )
