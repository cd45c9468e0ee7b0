"""Layer 7, export: to safetensors (``plan``, pure: headers and shards; ``to_safetensors``,
the streaming writer) and to Orbax (``orbax_plan``, pure: names, chunks, metadata;
``to_orbax``, the streaming writer).

May import: ``_save``, ``_restore``, ``_sources``, ``_io``, ``_format``, ``_layout`` and
``fnckpt._errors`` / ``fnckpt._version``.
"""
