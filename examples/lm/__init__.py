"""The example trainer as a package of files with one idea each; ``python examples/train_lm.py`` runs it (see
``main.py`` for the flags and presets, docs/trainer.md for what it shows)."""
