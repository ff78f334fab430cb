"""A small, real training job that exercises spotrun end to end: ``python -m
spotrun.examples.train_gpt`` (or under ``torchrun``) trains a byte-level GPT on the Python
standard library's source, checkpointing through :class:`spotrun.Checkpointer`.

May import the package's public names and every room below it but the command line.
"""
