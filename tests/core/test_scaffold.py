"""``redco new``: a template becomes a named project (tests/templates runs each project's tests)."""
import os
import re

import pytest

from redco.cli import main
from redco.scaffold import project_name, write_project


def test_minimal_project_is_written_and_named(tmp_path, capsys):
    dest = tmp_path / "my-model"
    main(["new", "--template", "minimal", str(dest)])
    assert "wrote" in capsys.readouterr().out
    assert sorted(os.listdir(dest)) == ["README.md", "main.py", "pyproject.toml", "tests"]
    assert 'name = "my_model"' in (dest / "pyproject.toml").read_text()
    assert "{{" not in (dest / "README.md").read_text()  # its tests run in tests/templates


def test_plugin_template_names_its_package_and_entry_point(tmp_path):
    dest = tmp_path / "sharding-plus"
    main(["new", "--template", "plugin", str(dest)])
    assert (dest / "sharding_plus" / "__init__.py").is_file()
    assert '"sharding_plus" = "sharding_plus"' in (dest / "pyproject.toml").read_text()


def test_existing_directory_and_unknown_template_are_refused(tmp_path, capsys, monkeypatch):
    with pytest.raises(FileExistsError, match="already exists"):
        write_project(str(tmp_path), str(tmp_path))
    monkeypatch.delenv("REDCO_DEBUG", raising=False)
    with pytest.raises(SystemExit) as ended:  # a user's mistake: one line, exit 2
        main(["new", "--template", "nope", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1, err
    assert re.match(r"redco new: No templates named 'nope'. Available: \[.*'minimal'", err), err
    with pytest.raises(ValueError, match="No templates named 'nope'"):  # --debug: the traceback
        main(["--debug", "new", "--template", "nope", str(tmp_path / "x")])
    assert project_name("/a/9lives") == "p_9lives"
