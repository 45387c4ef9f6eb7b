"""Training with a precision plan: the Trainer callback and the Accelerate plugin (``callback.py``, ``accelerate.py``),
the telemetry they log, error compensation, 8-bit saved activations and parameters added by a conversion.

Scale policies live in :mod:`hf_lowprec.scaling` (the layers use them); this package only reads them.
"""
