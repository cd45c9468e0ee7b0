"""Layer 4, reading stored checkpoints: opening one of any format (``source``: the opened
checkpoint, the default read window), reading any leaf's stored bytes under one byte window
(``read``: the one reader restore, export, verify and diff use; the read-error wording), telling
the formats apart (``detect``), Orbax and safetensors checkpoints (``orbax``, ``safetensors``),
slices of pieced leaves (``pieces``), and C-order pieces of saved leaves in a bounded window
(``slices``).

May import: ``_io``, ``_format``, ``_layout`` and ``fnckpt._errors`` / ``fnckpt._version``.
"""
