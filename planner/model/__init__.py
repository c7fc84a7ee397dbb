"""Whole models: plan each distinct region of a layer stack once (``stack``), the on-disk plan cache."""
