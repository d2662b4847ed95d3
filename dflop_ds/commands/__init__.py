"""The ``dflop-ds`` command line, the package's top layer: :mod:`~dflop_ds.commands.main` is the
entry point, and each other module adds its sub-commands through ``register(subparsers)``
(listed in :data:`dflop_ds.commands.main.COMMAND_MODULES`). Nothing below this layer imports it."""
