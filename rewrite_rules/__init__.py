"""Shipped rewrite rules, as egglog text files (see docs/rules.md)."""
