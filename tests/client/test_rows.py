"""RawInputs hands a batch's raw rows to the stages on the stages' device."""

import torch

from actcache_client.engine._rows import RawInputs

# "meta" stands in for a GPU here: a tensor moved there keeps shape and dtype, and says where it went.
DEVICE = torch.device("meta")


def test_rows_of_a_full_batch_go_to_the_device():
    inputs = torch.arange(12.0).reshape(4, 3)
    raw = RawInputs(inputs, 4, None, None, DEVICE)
    every = raw.rows([0, 1, 2, 3])
    some = raw.rows([3, 1])
    assert every.device == DEVICE and every.shape == (4, 3)
    assert some.device == DEVICE and some.shape == (2, 3)


def test_loaded_and_on_the_spot_rows_go_to_the_device():
    loads = []

    def load(rows):
        loads.append(rows)
        return (torch.ones(len(rows), 2), torch.zeros(len(rows), dtype=torch.long))

    inputs = (torch.full((1, 2), 7.0), torch.ones(1, dtype=torch.long))
    raw = RawInputs(inputs, 3, [2], load, DEVICE)  # only row 2 was loaded by the loader
    loaded = raw.rows([2])
    spot = raw.rows([0, 1])
    assert all(t.device == DEVICE for t in (*loaded, *spot))
    assert loads == [[0, 1]] and raw.count() == 3


def test_without_a_device_rows_stay_where_they_are():
    inputs = torch.arange(6.0).reshape(3, 2)
    raw = RawInputs(inputs, 3, None, None)
    assert raw.rows([0, 1, 2]) is inputs
    assert torch.equal(raw.rows([2, 0]), inputs[[2, 0]])
