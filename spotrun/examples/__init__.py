"""A small, real training job that exercises spotrun end to end.

``python -m spotrun.examples.train_gpt`` (or under ``torchrun``) trains a byte-level
GPT (:mod:`spotrun.examples.gpt`) on the Python standard library's source code
(:mod:`spotrun.examples.stdlib_text`), checkpointing through :class:`spotrun.Checkpointer`.
"""
