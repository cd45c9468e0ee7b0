"""Layer 1, pure layout rules: write chunks and read plans (``chunks``), packing small leaves
into packs (``packing``), and the pieces layout of chunks across writers (``pieces``). Data in,
data out: no I/O, no threads.

May import: ``fnckpt._errors`` and this package only.
"""
