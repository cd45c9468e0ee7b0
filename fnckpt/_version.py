"""The package's version: ``fnckpt.__version__``, written into every manifest."""

__version__ = "0.2.0"
