"""The label value of positions a loss skips: padding, prompts, the first token of a sequence.

Its own module so that the losses (the on-device loop, the scan) can use it without importing ``data.py``, whose
``datasets`` and ``pandas`` add about 90 MB of resident memory to a training process that reads no data through
them.
"""

IGNORE_INDEX = -100  # transformers' convention (its losses and collators skip it)
