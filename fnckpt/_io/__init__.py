"""Layer 3, storage and processes: locations and kvstores (``paths``, ``object_stores``), the
TensorStore calls for array data (``arrays``), local pack chunks and manifests written past
the page cache (``direct``), the commit marker (``commit``), and the
cross-process sessions, barriers and key-value store (``collective``, ``coordination``).

May import: ``_format``, ``_layout`` and ``fnckpt._errors`` / ``fnckpt._version``.
"""
