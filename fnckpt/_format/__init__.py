"""Layer 2, the checkpoint format: key paths (``tree``), the manifest's frozen
records and their encoding (``records``), validating untrusted manifest data into them
(``parse``; array records in ``parse_arrays``, field checks in ``parse_fields``), the
manifest's bytes (``manifest``), leaf kinds (``leaves``), references to other
checkpoints' data (``refs``), per-process values (``perprocess``), and the codec names the
format allows (``codecs``). Pure: records and bytes in, records and bytes out.

May import: ``_layout`` and ``fnckpt._errors`` / ``fnckpt._version``.
"""
