"""Algorithms: context windows, rolling hashes, the AR tags and their kernels, n-gram counts and the JIT."""
