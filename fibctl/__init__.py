"""fibctl: reproduce and extend the scaled-Fibonacci sparse-attention study."""

__version__ = "0.1.0"
