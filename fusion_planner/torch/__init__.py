"""The torch layer: tracing a module, importing it into the IR, binding its parameters, and the
torch-backed Opaque implementations. Importing this package itself imports no torch.
"""
