"""Boolean buffers that are set once (``calibrated``, ``initialized``) and read on every forward: read from the device
until they are found set, then known on the host, so a GPU step does not sync on them."""

from __future__ import annotations

from torch import nn


class OnceFlags(nn.Module):
    """A module with 0-d bool buffers that go from ``False`` to ``True`` once. :meth:`flag_set` reads one until it is
    ``True`` and remembers that; :meth:`set_flag` sets it; loading a state dict forgets what was remembered (the
    loaded buffers decide)."""

    def __init__(self):
        super().__init__()
        self._flags_known_set: set[str] = set()

    def flag_set(self, name: str) -> bool:
        if name in self._flags_known_set:
            return True
        if bool(getattr(self, name)):  # one host sync, until the flag is set
            self._flags_known_set.add(name)
            return True
        return False

    def set_flag(self, name: str) -> None:
        getattr(self, name).fill_(True)
        self._flags_known_set.add(name)

    def _load_from_state_dict(self, *args, **kwargs):
        self._flags_known_set.clear()
        return super()._load_from_state_dict(*args, **kwargs)
