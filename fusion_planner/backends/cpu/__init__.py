"""The generated-C CPU backend (``backend``), its code generator (``codegen``) and calibration."""
