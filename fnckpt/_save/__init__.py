"""Layer 6, save: ``save()``, ``start`` and the handle (``save``), the background writer
(``writer``), save's side of pieces (``pieces``), incremental saves' hashes and reuse
(``delta``), the staged copy of a packed leaf (``staged``) and the wording of a failed save
(``errors``).

May import: ``_restore``, ``_sources``, ``_io``, ``_format``, ``_layout`` and
``fnckpt._errors`` / ``fnckpt._version``.
"""
