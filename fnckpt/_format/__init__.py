"""Layer 2, the checkpoint format: key paths (``tree``), the manifest's validated records
(``records``) and its bytes (``manifest``), leaf kinds (``leaves``), references to other
checkpoints' data (``refs``), per-process values (``perprocess``), and the codec names the
format allows (``codecs``). Pure: records and bytes in, records and bytes out.

May import: ``_layout`` and ``fnckpt._errors`` / ``fnckpt._version``.
"""
