"""Layer 5, restore: ``restore()`` and ``metadata()`` with their public metadata types
(``restore``), the arrays read through ``_sources.read`` and placed as they land (``place``),
target shardings made placeable (``shardings``: abstract meshes, the mesh in context, memory
kinds, layouts), and ``target_from_metadata`` (``target``).

May import: ``_sources``, ``_io``, ``_format``, ``_layout`` and ``fnckpt._errors`` /
``fnckpt._version``.
"""
