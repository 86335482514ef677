"""Which device gets the next batch, as plain data: devices up or taken out, and the batch
slots each has free.

Why a separate module: the device pool (device_pool.py) mixes this choice with processes,
pipes and threads; here it is synchronous and free of them, so tests drive it step by step.
Not thread-safe: the pool calls it under its own lock.

The choice: the device with the fewest batches in flight, ties to the lowest index. Each
device has a fixed number of slots (shared-memory buffers), so a device with every slot
taken is never chosen, and a batch waits (`choose` returns None) only while every device
that is up is full. A batch of a recording's windows, which lie on one device, waits for a
slot of that device alone (`choose(device)`).

A recording's home: the device up with the fewest recordings open, ties to the fewest
batches in flight, then the lowest index (`home`). A recording stays on its home from its
first byte to its last embedding; recordings, not their windows, are what is spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Lease:
    """Slot `slot` of device `device`, held by one batch until released."""

    device: int
    slot: int


@dataclass
class _Device:
    index: int
    free: list[int] = field(default_factory=list)  # slot numbers, lowest handed out first
    slots: int = 0
    up: bool = True
    recordings: int = 0  # recordings open with this device as their home

    @property
    def in_flight(self) -> int:
        return self.slots - len(self.free)


class DeviceTable:
    """Devices `devices`, each with `slots_per_device` slots (see the module docstring)."""

    def __init__(self, devices: Sequence[int], slots_per_device: int) -> None:
        if not devices:
            raise ValueError("devices: none given; expected at least one device index")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices: {list(devices)} lists a device twice")
        if slots_per_device < 1:
            raise ValueError(f"slots_per_device: {slots_per_device}, expected at least 1")
        slots = list(range(slots_per_device))
        self._devices = {index: _Device(index, list(slots), slots_per_device) for index in sorted(devices)}

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device listed, up or not, ascending."""
        return tuple(self._devices)

    @property
    def live(self) -> tuple[int, ...]:
        """Devices still up, ascending."""
        return tuple(index for index, device in self._devices.items() if device.up)

    def is_up(self, device: int) -> bool:
        return self._devices[device].up

    def in_flight(self, device: int) -> int:
        """Batches holding a slot of `device` (0 once it is taken out)."""
        state = self._devices[device]
        return state.in_flight if state.up else 0

    def choose(self, device: int | None = None) -> Lease | None:
        """Take a slot on the least-loaded device that is up and has one free (ties: lowest
        index), or on `device` alone when given; None when none of those is up with a slot
        free."""
        candidates = [
            state
            for state in self._devices.values()
            if state.up and state.free and (device is None or state.index == device)
        ]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda d: (d.in_flight, d.index))
        return Lease(chosen.index, chosen.free.pop(0))

    def recordings(self, device: int) -> int:
        """Recordings open with `device` as their home (0 once it is taken out)."""
        state = self._devices[device]
        return state.recordings if state.up else 0

    def home(self) -> int | None:
        """Open a recording on the device up with the fewest open (ties: fewest batches in
        flight, then the lowest index) and return it; None when no device is up."""
        live = [state for state in self._devices.values() if state.up]
        if not live:
            return None
        chosen = min(live, key=lambda d: (d.recordings, d.in_flight, d.index))
        chosen.recordings += 1
        return chosen.index

    def leave(self, device: int) -> None:
        """A recording whose home was `device` ended (a no-op once the device is out)."""
        state = self._devices[device]
        if not state.up:
            return
        if state.recordings < 1:
            raise ValueError(f"device {device}: no recording open to leave")
        state.recordings -= 1

    def release(self, lease: Lease) -> None:
        """Give a lease's slot back (a no-op once its device is out: its slots are never reused,
        a dead worker may still have been writing into them)."""
        device = self._devices[lease.device]
        if not device.up:
            return
        if lease.slot in device.free or not 0 <= lease.slot < device.slots:
            raise ValueError(f"lease {lease}: slot {lease.slot} is not held")
        device.free.append(lease.slot)
        device.free.sort()

    def take_out(self, device: int) -> bool:
        """Never choose `device` again; True the first time (the caller reports it once)."""
        state = self._devices[device]
        if not state.up:
            return False
        state.up = False
        return True
