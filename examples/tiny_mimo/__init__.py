"""A tiny trained MiMo-format target + MTP checkpoint and a lossless reference verifier."""
