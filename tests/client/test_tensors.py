import numpy as np
import pytest
import torch

from actcache._proto import actcache_pb2 as pb
from actcache.entries import EntryBatch
from actcache.errors import InvalidRequest
from actcache.shm import ClientSegment, ShmRing
from actcache_client.transport._tensors import VarLen, collate_entries, encode_samples, run_layout, split_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", [0, 1])
def test_batch_round_trip_every_dtype(dtype, level):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 7, generator=g) * 50).to(dtype)
    entries = encode_samples(x, zstd_level=level)
    assert len(entries) == 5
    assert torch.equal(collate_entries(entries), x)
    assert torch.equal(collate_entries(entries[2:4]), x[2:4])


def test_tuple_states_round_trip():
    state = (torch.randn(4, 6), torch.arange(4, dtype=torch.int64), torch.ones(4, 2, 2, dtype=torch.bool))
    out = collate_entries(encode_samples(state))
    assert isinstance(out, tuple) and all(torch.equal(a, b) for a, b in zip(out, state))


def test_varlen_stores_only_real_tokens_and_repads():
    hidden = torch.randn(3, 6, 64)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    entries = encode_samples((hidden, mask), varlen=VarLen())
    dense = encode_samples(hidden)
    assert sum(map(len, entries)) < sum(map(len, dense)) / 2  # 7 of 18 rows stored
    h2, m2 = collate_entries(entries, varlen=VarLen())
    assert h2.shape == (3, 4, 64)  # padded to the longest sample of the batch
    assert torch.equal(m2, mask[:, :4])
    assert torch.equal(h2 * m2[..., None], (hidden * mask[..., None])[:, :4])
    with pytest.raises(InvalidRequest, match="right padding"):
        encode_samples((hidden, torch.tensor([[0, 1, 1, 0, 0, 0]] * 3)), varlen=VarLen())


def test_unsupported_dtype_and_mismatched_batch_are_clear():
    with pytest.raises(InvalidRequest, match="cannot cache tensors of dtype torch.float64"):
        encode_samples(torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(InvalidRequest, match="batch dimension"):
        encode_samples((torch.zeros(2, 2), torch.zeros(3)))
    a, b = encode_samples(torch.zeros(1, 2))[0], encode_samples(torch.zeros(1, 3))[0]
    with pytest.raises(InvalidRequest, match="batch expects"):
        collate_entries([a, b])


@pytest.mark.parametrize("dtype", DTYPES)
def test_served_entries_of_one_layout_collate_like_any_others(dtype):
    # Fetch serves entries unverified (verify=False): those of one layout are copied without parsing
    # each header. Raw entries of one layout differ in their checksums only.
    g = torch.Generator().manual_seed(1)
    state = ((torch.randn(6, 3, 5, generator=g) * 50).to(dtype), torch.arange(6, dtype=torch.int64))
    entries = encode_samples(state)
    assert len({bytes(e[24:28]) for e in entries}) > 1  # per-entry checksums: the layouts match, the bytes do not
    fast = collate_entries(entries, verify=False)
    assert all(torch.equal(a, b) for a, b in zip(fast, state))
    assert all(torch.equal(a, b) for a, b in zip(fast, collate_entries(entries)))


def test_served_entries_of_mixed_layouts_are_still_checked():
    entries = encode_samples(torch.randn(2, 4)) + encode_samples(torch.randn(2, 5))
    with pytest.raises(InvalidRequest, match="batch expects"):
        collate_entries(entries, verify=False)


def in_ring(tmp_path, entries):
    """``entries`` written into consecutive slots of a real shared-memory ring: (views, their run)."""
    ring = ShmRing(1 << 20, 0, directory=tmp_path)
    segment = ClientSegment(str(ring.path))
    offsets = [ring.alloc(i, len(e)) for i, e in enumerate(entries)]
    for offset, e in zip(offsets, entries):
        ring.view(offset, len(e))[:] = e
    header = pb.EntriesHeader(start=0, sample_ids=range(len(entries)), lengths=[len(e) for e in entries], offsets=offsets)
    batch = EntryBatch.from_slots(header, segment)
    return batch.values, batch.run


@pytest.mark.parametrize("dtype", DTYPES)
def test_entries_in_consecutive_ring_slots_collate_in_one_copy_and_split_alike(tmp_path, dtype):
    state = ((torch.randn(6, 3, 5) * 50).to(dtype), torch.arange(6, dtype=torch.int64), torch.zeros(6, 0))
    values, run = in_ring(tmp_path, encode_samples(state))
    assert run is not None and run.skip(2).offset == run.offset + 2 * run.size
    collated = collate_entries(values, verify=False, run=run)
    split = split_rows(torch.from_numpy(np.frombuffer(run.segment.view, np.uint8, 6 * run.size, run.offset).copy())
                       .view(6, run.size), run_layout(run, 6))
    for out in (collated, split):
        assert all(torch.equal(a, b) for a, b in zip(out, state))
    assert torch.equal(collate_entries(values[1:5], verify=False, run=run.skip(1))[0], state[0][1:5])


def test_a_run_of_mixed_layouts_falls_back_to_checking_each_entry(tmp_path):
    entries = encode_samples(torch.randn(4, 4, 8))
    entries[2] = encode_samples(torch.randn(1, 8, 4))[0]  # as many bytes, another shape
    values, run = in_ring(tmp_path, entries)
    assert run is not None and run_layout(run, 4) is None
    with pytest.raises(InvalidRequest, match="sample 2"):
        collate_entries(values, verify=False, run=run)


def test_only_hits_of_one_size_in_consecutive_slots_make_a_run(tmp_path):
    ring = ShmRing(1 << 20, 0, directory=tmp_path)
    segment = ClientSegment(str(ring.path))
    a, b, c = (ring.alloc(i, 64) for i in range(3))
    frame = lambda offsets, lengths: EntryBatch.from_slots(  # noqa: E731
        pb.EntriesHeader(start=0, sample_ids=range(len(offsets)), lengths=lengths, offsets=offsets), segment)
    assert frame([a, b, c], [64, 64, 64]).run is not None
    assert frame([a, 0, c], [64, 0, 64]).run is None  # a miss between
    assert frame([a, c], [64, 64]).run is None  # not adjacent
    assert frame([a, b], [64, 32]).run is None  # two sizes


def test_a_row_copier_collates_variable_length_entries_as_one_thread_does():
    """The rows of a batch split across threads: the same batch, padding zeroed, whatever the slot held."""
    from actcache_client.transport._tensors import RowCopier

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 9, 4, generator=g)
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 3, 5, 1, 7, 2])[:, None]).long()
    entries = encode_samples((hidden, mask), varlen=VarLen())
    garbage = lambda shape, dtype: torch.full(shape, 7, dtype=dtype)  # noqa: E731  a reused slot's old bytes
    copier = RowCopier(3, min_bytes=0)
    try:
        threaded = collate_entries(entries, varlen=VarLen(), alloc=garbage, copy=copier)
    finally:
        copier.close()
    alone = collate_entries(entries, varlen=VarLen())
    assert all(torch.equal(a, b) for a, b in zip(threaded, alone))
    assert torch.equal(threaded[0], hidden * mask[..., None])
