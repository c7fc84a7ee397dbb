"""Rules: reading rule files, the rules generated from the op table, the soundness checker, and the
shipped ``.egg`` files (``shipped/``, package data).
"""
