"""The compression codecs the format allows for stored arrays (``store.blosc`` of a manifest's
leaf records; zstd is a level), and save's default blosc settings. Pure constants: the readers
(``records``) and the writers (``fnckpt._io.arrays``) share them."""

__all__ = ["BLOSC", "BLOSC_CNAMES", "BLOSC_SHUFFLES"]

# ``save(compression="blosc")``: of the codecs measured on real training state (params fp32,
# Adam mu bf16 / nu fp32; bench/compression.py), blosc's lz4 with bit shuffling compressed most
# per CPU second spent (docs/performance.md "Compression").
BLOSC = {"cname": "lz4", "clevel": 5, "shuffle": "bitshuffle"}
BLOSC_CNAMES = frozenset(("lz4", "lz4hc", "blosclz", "zstd", "zlib"))
BLOSC_SHUFFLES = frozenset(("noshuffle", "shuffle", "bitshuffle"))
