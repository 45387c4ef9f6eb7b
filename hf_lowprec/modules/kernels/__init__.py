"""CPU kernels of the packed layers and the measured choice among them.

``cpu.py`` says what this CPU can do, ``cpp.py`` holds the hand-written C++ kernels, ``autotune.py`` times the
candidates a CPU can run and caches the winner per machine.
"""
