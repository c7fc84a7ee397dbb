"""Rules: reading rule files, the rules generated from the op table, the soundness checker, and loading
the shipped rules (the ``rewrite_rules`` package's ``.egg`` files) with the user's.
"""
