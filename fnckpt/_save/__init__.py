"""Layer 6, save: ``save()`` and ``start`` (``save``), the options it is asked for
(``options``), its pure plan (``plan``), the caller's handle, ``fnckpt.wait()`` and the
pending saves (``handle``), staging off the devices under the host budget (``staging``,
``copies``, ``buffers``), the background writer (``writer``), which chunks this process writes
as pieces (``piece_writes``), incremental saves' hashes and reuse (``delta``, ``pending``), the
staged copy of a packed leaf (``staged_leaf``) and the wording of a failed save (``errors``).

May import: ``_restore``, ``_sources``, ``_io``, ``_format``, ``_layout`` and
``fnckpt._errors`` / ``fnckpt._version``.
"""
