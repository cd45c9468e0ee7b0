"""Layer 6, save: ``save()`` and ``start`` (``save``), the caller's handle, ``fnckpt.wait()``
and the pending saves (``handle``), staging off the devices under the host budget
(``staging``), the background writer (``writer``), save's side of pieces (``pieces``),
incremental saves' hashes and reuse (``delta``), the staged copy of a packed leaf (``staged``)
and the wording of a failed save (``errors``).

May import: ``_restore``, ``_sources``, ``_io``, ``_format``, ``_layout`` and
``fnckpt._errors`` / ``fnckpt._version``.
"""
