"""Built-in observers of a training run, one concern per file. Each is a class made once per
``Trainer`` (``cls(trainer)``) whose ``@redco.hookimpl`` methods are called on that Trainer's
lifecycle hooks (``redco/hookspecs.py``). They are registered in ``redco/builtins/observers.py``
through ``register_observers``, the hook a third-party plugin uses to add its own."""
