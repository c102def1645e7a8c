"""Built-in storage backends, each a plugin registered exactly as a third-party one is.

Every backend is a package of the same three modules:

* ``<name>/__init__.py``: the plugin (the module ``kvtier.plugins.manager`` loads and
  ``KVTIER_DISABLE_PLUGINS`` names): the backend's ``BackendSpec`` and its
  ``kvtier_register_backends`` hook implementation, re-exporting the config model. It
  imports nothing optional and not the backend module, so ``kvtier backends`` can list
  a backend whose dependencies are missing; the spec's factory is a lazy
  ``"kvtier.backends.<name>.backend:<Name>Backend"`` string, imported when it is built.
* ``<name>/config.py``: the pydantic config model (and the plan check, where there is one).
* ``<name>/backend.py``: the backend class, built as ``<Name>Backend(config, context)``;
  it imports what the backend needs, optional dependencies included.

A backend may add modules of its own: ``uring/probe.py`` (the availability probe) and
``uring/ring.py`` (the io_uring engine), ``mooncake/probe.py``. ``filestore/`` is not a
backend but the on-disk scheme that ``file`` and ``uring`` share, one job per module:
``options``, ``paths``, ``writes``, ``startup``, ``index`` (see its docstring).
"""
