"""Data files that ship inside the package (see README.md here for sources and licenses)."""
