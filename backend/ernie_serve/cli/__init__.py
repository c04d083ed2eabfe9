"""Console entry points (ernie-serve)."""
