"""Sub-commands of ``dflop-ds`` that use the training loop's pieces (the top layer); each module
adds its command through ``register(subparsers)``, listed in :data:`dflop_ds.cli.COMMAND_MODULES`."""
