"""Layer 4, reading stored checkpoints: opening one of any format and reading a leaf's bytes
(``source``: the opened checkpoint, the read window, the read-error classification), telling
the formats apart (``detect``), Orbax and safetensors checkpoints (``orbax``, ``safetensors``),
slices of pieced leaves (``pieces``), and C-order pieces of saved leaves in a bounded window
(``slices``).

May import: ``_io``, ``_format``, ``_layout`` and ``fnckpt._errors`` / ``fnckpt._version``.
"""
