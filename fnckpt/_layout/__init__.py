"""Layer 1, pure layout rules: write chunks and read plans (``chunks``), packing small leaves
into packs (``packing``), the pieces layout of chunks across writers (``pieces``), and the
regions readers cut arrays into (``blocks``), where a pack chunk's bytes lie in its file
(``shard``). Data in, data out: no I/O, no threads.

May import: ``fnckpt._errors`` and this package only.
"""
