"""The e-graph layer: building and saturating the egglog program, the extractor and the costed candidates."""
