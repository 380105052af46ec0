"""A zoo package states its three functions twice: in ``pipeline.py`` (what ``redco zoo run NAME``
runs) and in its template's ``main.py`` (what ``redco new --template NAME`` copies for a user to
edit; the project must stand alone, so main.py cannot import them from the package). These tests
keep the two copies one source: a fix made in one file and not the other fails here.

For every registered template with a zoo pipeline of the same name:

* ``collate_fn``, ``loss_fn`` and ``pred_fn`` are defined at the top level of both files;
* every top-level function or class defined in both files (the three functions, ``metric_fn``,
  ``apply_fn``, ``init_params``, a shared ``train`` driver, ...) has the same source, compared as
  ``ast.unparse`` of its definition: comments and line breaks may differ; code, signatures,
  defaults, type hints and docstrings may not;
* the module-level names those shared definitions use (``runner``, ``generate``, ``pixels``,
  ``mlp``, ...) and their default values are the same objects in both modules, so the same
  source also means the same thing (a helper imported from elsewhere in one file fails here).
"""
from __future__ import annotations

import ast
import difflib
import dis
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path

import pytest

from redco.plugins import registry

THREE = {"collate_fn", "loss_fn", "pred_fn"}
PIPELINES = registry("zoo_pipelines")
TEMPLATES = registry("templates")
PAIRS = sorted(set(PIPELINES) & set(TEMPLATES))
MISSING = object()
ZOO = Path(__file__).resolve().parents[2] / "zoo"
IN_REPO = sorted(d.name for d in ZOO.iterdir()  # zoo/NAME/redco_zoo_NAME/{pipeline.py,template}
                 if (d / f"redco_zoo_{d.name}" / "pipeline.py").is_file()
                 and (d / f"redco_zoo_{d.name}" / "template" / "main.py").is_file())


def pipeline_module(name: str) -> types.ModuleType:
    return sys.modules[type(PIPELINES[name]).__module__]


def package(name: str) -> str:
    return pipeline_module(name).__name__.partition(".")[0]


def template_main(name: str) -> str:
    return os.path.join(TEMPLATES[name], "main.py")


def definitions(path: str) -> dict[str, str]:
    """Top-level functions and classes of the file at ``path``: name -> ``ast.unparse`` source."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return {node.name: ast.unparse(node) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def differences(name: str) -> list[str]:
    """One message per definition whose source differs between the two files (with a diff)."""
    pipeline_path, main_path = pipeline_module(name).__file__, template_main(name)
    ours, theirs = definitions(pipeline_path), definitions(main_path)
    messages = []
    for shared in sorted(set(ours) & set(theirs)):
        if ours[shared] != theirs[shared]:
            diff = difflib.unified_diff(ours[shared].splitlines(), theirs[shared].splitlines(),
                                        pipeline_path, main_path, lineterm="")
            messages.append(f"zoo package {package(name)}: {shared} differs between pipeline.py "
                            "and template/main.py; make both the same code:\n"
                            + "\n".join(diff))
    return messages


def load_template_main(name: str) -> types.ModuleType:
    """The template's main.py imported as a module of its own (not run: it has a main guard)."""
    spec = importlib.util.spec_from_file_location(f"template_main_{name}", template_main(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def functions_of(obj) -> list[types.FunctionType]:
    if inspect.isclass(obj):
        return [inspect.unwrap(getattr(m, "__func__", m)) for m in vars(obj).values()
                if inspect.isfunction(getattr(m, "__func__", m))]
    return [obj] if inspect.isfunction(obj) else []


def global_names(code: types.CodeType) -> set[str]:
    """Module-level names that ``code`` and the functions nested in it read."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def same_object(a, b) -> bool:
    plain = (int, float, complex, str, bytes, bool, tuple, frozenset, type(None))
    return a is b or (isinstance(a, plain) and type(a) is type(b) and a == b)


def same_defaults(f: types.FunctionType, g: types.FunctionType) -> bool:
    defaults, kwdefaults = (f.__defaults__ or (), g.__defaults__ or ()), (f.__kwdefaults__ or {},
                                                                          g.__kwdefaults__ or {})
    return (len(defaults[0]) == len(defaults[1]) and all(map(same_object, *defaults))
            and kwdefaults[0].keys() == kwdefaults[1].keys()
            and all(same_object(v, kwdefaults[1][k]) for k, v in kwdefaults[0].items()))


def unequal_bindings(name: str, shared: set[str]) -> list[str]:
    """For each shared definition, the globals and defaults it uses that differ between modules."""
    pipeline, main = pipeline_module(name), load_template_main(name)
    messages = []
    for definition in sorted(shared):
        for f, g in zip(functions_of(getattr(pipeline, definition)),
                        functions_of(getattr(main, definition))):
            for used in sorted(global_names(f.__code__) - shared):
                a, b = vars(pipeline).get(used, MISSING), vars(main).get(used, MISSING)
                if not same_object(a, b):
                    messages.append(f"zoo package {package(name)}: {definition} uses {used!r}, "
                                    f"which is {a!r} in pipeline.py but {b!r} in template/main.py; "
                                    "import the same object in both (or define it in both, the same).")
            if not same_defaults(f, g):
                messages.append(f"zoo package {package(name)}: {f.__qualname__}'s default values "
                                f"differ: {f.__defaults__} {f.__kwdefaults__} in pipeline.py, "
                                f"{g.__defaults__} {g.__kwdefaults__} in template/main.py.")
    return messages


def test_every_zoo_pipeline_is_compared_with_its_template():
    """Each zoo package of this repository is installed and loads: a package that fails to load
    (its plugin skipped with a warning) would otherwise drop out of the comparison silently."""
    assert len(IN_REPO) >= 6, IN_REPO
    unregistered = set(IN_REPO) - set(PAIRS)
    assert not unregistered, (f"zoo packages {sorted(unregistered)} register no pipeline and template "
                              "of their name: pip install -e zoo/NAME, and see the warnings of "
                              "plugins that failed to load.")
    assert PAIRS == sorted(PIPELINES), (PAIRS, sorted(PIPELINES))


@pytest.mark.parametrize("name", PAIRS)
def test_pipeline_and_template_define_the_three_functions(name):
    for path in (pipeline_module(name).__file__, template_main(name)):
        missing = THREE - set(definitions(path))
        assert not missing, (f"zoo package {package(name)}: {path} defines no {sorted(missing)} at "
                             "its top level; both pipeline.py and template/main.py state the three.")


@pytest.mark.parametrize("name", PAIRS)
def test_functions_in_both_files_have_the_same_source(name):
    messages = differences(name)
    assert not messages, "\n\n".join(messages)


@pytest.mark.parametrize("name", PAIRS)
def test_shared_functions_use_the_same_helpers(name):
    shared = set(definitions(pipeline_module(name).__file__)) & set(definitions(template_main(name)))
    messages = unequal_bindings(name, shared)
    assert not messages, "\n".join(messages)
