"""Plugins that ship with redco. Each is registered through the ``redco`` entry-point group in
``core/pyproject.toml``, exactly like a third-party plugin."""
