"""``redco new``: copy a template directory into a new project, naming it."""
from __future__ import annotations

import os
import re
import shutil

PLACEHOLDER = "{{project_name}}"
SKIPPED = {"__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"}  # caches, not template


def project_name(dest: str) -> str:
    """``dest``'s last part as a Python identifier (``my-proj`` -> ``my_proj``)."""
    name = re.sub(r"\W", "_", os.path.basename(os.path.abspath(dest)))
    return name if name[:1].isalpha() else f"p_{name}"


def write_project(template_dir: str, dest: str) -> str:
    """Copy ``template_dir`` to ``dest`` (which must not exist), replacing ``{{project_name}}``
    in file names and text files. Returns ``dest``."""
    if os.path.exists(dest):
        raise FileExistsError(f"{dest} already exists; pick a new directory for the project.")
    name = project_name(dest)
    for root, dirs, files in os.walk(template_dir):
        dirs[:] = [d for d in dirs if d not in SKIPPED]
        target = os.path.join(dest, os.path.relpath(root, template_dir).replace(PLACEHOLDER, name))
        os.makedirs(target, exist_ok=True)
        for file in files:
            source, out = os.path.join(root, file), os.path.join(target, file.replace(PLACEHOLDER, name))
            try:
                with open(source, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError:  # not text: copied as is
                shutil.copyfile(source, out)
                continue
            with open(out, "w", encoding="utf-8") as f:
                f.write(text.replace(PLACEHOLDER, name))
    return dest
