"""The device choice of `serve --devices` as plain data (speakerd/serving/devices/device_table.py):
least-loaded first, ties to the lowest index, full devices skipped, taken-out devices never
chosen again. No processes: the pool's processes are tested in tests/test_devices.py."""

from __future__ import annotations

import pytest

from speakerd.serving.devices.device_table import DeviceTable, Lease


def test_least_loaded_device_first_ties_to_the_lowest_index() -> None:
    table = DeviceTable([1, 0, 2], slots_per_device=3)
    # all idle: 0, then 1, then 2 (ties by index); then round again as loads even out
    chosen = [table.choose() for _ in range(4)]
    assert [lease.device for lease in chosen] == [0, 1, 2, 0]
    assert [lease.slot for lease in chosen] == [0, 0, 0, 1]
    table.release(chosen[1])  # device 1 now has none in flight: it is the least loaded
    assert table.choose() == Lease(1, 0)
    assert [table.in_flight(device) for device in (0, 1, 2)] == [2, 1, 1]


def test_a_full_device_is_skipped_and_none_when_all_are_full() -> None:
    table = DeviceTable([0, 1], slots_per_device=2)
    leases = [table.choose() for _ in range(4)]
    assert sorted((lease.device, lease.slot) for lease in leases) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert table.choose() is None  # every slot of every device taken: the batch waits
    table.release(Lease(1, 1))
    assert table.choose() == Lease(1, 1)


def test_a_device_taken_out_is_never_chosen_and_its_slots_not_reused() -> None:
    table = DeviceTable([0, 1], slots_per_device=2)
    on_one = [table.choose(), table.choose()][1]
    assert on_one == Lease(1, 0)
    assert table.take_out(1) is True
    assert table.take_out(1) is False  # reported once
    assert table.live == (0,) and table.devices == (0, 1)
    assert table.in_flight(1) == 0
    table.release(on_one)  # a batch of the dead device coming back: ignored, never reused
    assert [table.choose(), table.choose()] == [Lease(0, 1), None]
    assert table.take_out(0) is True
    assert table.live == () and table.choose() is None


def test_release_of_a_slot_not_held_is_an_error() -> None:
    table = DeviceTable([0], slots_per_device=1)
    with pytest.raises(ValueError, match="slot 0 is not held"):
        table.release(Lease(0, 0))


@pytest.mark.parametrize(
    ("devices", "slots", "message"),
    [([], 1, "at least one device"), ([0, 0], 1, "lists a device twice"), ([0], 0, "at least 1")],
)
def test_bad_tables_are_refused(devices: list[int], slots: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeviceTable(devices, slots)


def test_a_recordings_batch_waits_for_its_own_device() -> None:
    """A recording's windows lie on its home device: `choose(device)` takes a slot there or
    none, even when another device is idle."""
    table = DeviceTable([0, 1], slots_per_device=2)
    assert [table.choose(1), table.choose(1)] == [Lease(1, 0), Lease(1, 1)]
    assert table.choose(1) is None, "device 1 is full: its recording's batch waits for it"
    assert table.choose() == Lease(0, 0), "unbound batches still go to the idle device"
    table.release(Lease(1, 0))
    assert table.choose(1) == Lease(1, 0)
    table.take_out(1)
    assert table.choose(1) is None


def test_recordings_are_spread_by_open_recordings_then_load() -> None:
    table = DeviceTable([0, 1, 2], slots_per_device=3)
    table.choose(0)  # device 0 has a batch in flight
    homes = [table.home() for _ in range(4)]
    assert homes == [1, 2, 0, 1], "fewest recordings first, ties to fewer batches, then index"
    assert [table.recordings(d) for d in (0, 1, 2)] == [1, 2, 1]
    table.leave(1)
    table.leave(1)
    assert table.home() == 1
    table.leave(2)
    with pytest.raises(ValueError, match="device 2: no recording open"):
        table.leave(2)
    table.take_out(0)
    assert table.recordings(0) == 0 and table.home() == 2
    table.leave(0)  # a recording of a device taken out ending: nothing to count
    table.take_out(1)
    table.take_out(2)
    assert table.home() is None, "no device up: no home"
