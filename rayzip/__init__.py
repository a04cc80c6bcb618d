"""rayzip: elastic PyTorch training on Ray that compresses what crosses the network."""

__version__ = "0.1.0"
