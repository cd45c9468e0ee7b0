"""Layer 7, export to safetensors: the plan of headers and shards (``plan``, pure) and the
streaming writer (``export``).

May import: ``_save``, ``_restore``, ``_sources``, ``_io``, ``_format``, ``_layout`` and
``fnckpt._errors`` / ``fnckpt._version``.
"""
